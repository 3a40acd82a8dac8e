"""RVT-S* (`rvt_small_plus`) with RSPC on ImageNet-1k at 224x224 (TPU v3-32 or larger).

    python -m rspc_jax.main --config=configs/rvt_s.py --workdir=gs://BUCKET/rspc/rvt_s

Needs `imagenet2012` prepared in TFDS_DATA_DIR (README, "Datasets"). Recipe of the
official RSPC-RVT-S run (docs/method.md, 'Recipes: RVT'): global batch 2048 (128 per GPU), AdamW lr
2e-3, 5 warm-up epochs, cosine over 300 + 10 cool-down epochs, drop path 0.1,
RandAugment, random erasing 0.25, repeated augmentation x3, mixup/cutmix, EMA 0.99996,
patch-wise augmentation (official), rho 0.1, lambda 0.005. The official Ti/S runs use
fp16 autocast: `--config.compute_dtype=bfloat16` is the TPU counterpart.
Paper (Table 2): RSPC-RVT-S 82.2% top-1, 48.4 ImageNet-C mCE, 27.9% ImageNet-A
(RVT-S 81.9 / 49.4 / 25.7 = `:plain`). Not reproduced by us. `:smoke`: a tiny RVT*
on the digits at 224 px for a few steps on CPU.
"""

from rspc_jax.training import defaults, recipes


def get_config(arg=None):
    c = defaults.get_default_config()
    c.model_name = "rvt_small_plus"
    recipes.apply_imagenet_recipe(c, batch_size=2048, per_device_batch=128)
    c.patch_aug = "official"
    return recipes.select_variant(
        c,
        arg,
        smoke=lambda c: recipes.apply_smoke(
            c,
            "rvt_small_plus",
            dict(base_dims=(8,), depth=(2,), heads=(2,), masked_block=1, drop_path_rate=0.1),
            image_size=224,
        ),
    )
