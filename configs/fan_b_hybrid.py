"""FAN-B-Hybrid (`fan_base_16_p4_hybrid`) with RSPC on ImageNet-1k at 224x224
(TPU v3-32 or larger).

    python -m rspc_jax.main --config=configs/fan_b_hybrid.py --workdir=gs://BUCKET/rspc/fan_b_hybrid

Needs `imagenet2012` prepared in TFDS_DATA_DIR (README, "Datasets"). Recipe of the
official RSPC-FAN run (docs/method.md, 'Recipes: FAN'): global batch 4096, AdamW lr 4e-3 (absolute),
10 warm-up epochs from 1e-6, cosine to 1e-6 over 300 + 10 cool-down epochs, wd 0.05,
constant drop path 0.35, RandAugment m9-mstd0.5, random erasing 0.3, no repeated
augmentation, mixup 0.8 / cutmix 1.0 / smoothing 0.1, EMA 0.99992, seed 42; rho 0.1,
lambda 0.005. The official runs use fp16 autocast: `--config.compute_dtype=bfloat16` is
the TPU counterpart; timm's random train interpolation is bicubic here.
Paper (Table 2): RSPC-FAN-B-Hybrid 84.2% top-1, 44.5 ImageNet-C mCE, 41.1%
ImageNet-A (FAN-B-Hybrid 83.9 / 46.1 / 39.6 = `:plain`).
Not reproduced by us. `:smoke`: a tiny FAN-Hybrid on the digits for a few steps on CPU.
"""

from rspc_jax.training import defaults, recipes


def get_config(arg=None):
    c = defaults.get_default_config()
    c.model_name = "fan_base_16_p4_hybrid"
    recipes.apply_fan_recipe(c, batch_size=4096, lr=4e-3, warmup_epochs=10, drop_path_rate=0.35)
    return recipes.select_variant(
        c,
        arg,
        smoke=lambda c: recipes.apply_smoke(
            c,
            "fan_base_16_p4_hybrid",
            dict(
                embed_dim=16,
                depth=2,
                num_heads=2,
                stem_depths=(1, 1),
                stem_dims=(8, 16),
                cls_attn_layers=1,
                drop_path_rate=0.35,
            ),
        ),
    )
