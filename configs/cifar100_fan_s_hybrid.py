"""FAN-S-Hybrid with RSPC on CIFAR100 at 224x224 (up-sampled), the paper's Table 1 setting.

    python -m rspc_jax.main --config=configs/cifar100_fan_s_hybrid.py --workdir=gs://BUCKET/rspc/cifar100_fan_s_hybrid

Needs `cifar100` prepared in TFDS_DATA_DIR (README, "Datasets"). `fan_small_12_p4_hybrid` from scratch
with the official EXP_CIFAR recipe, `rspc_jax.training.recipes.apply_cifar224_recipe`
(docs/method.md, 'Recipes: CIFAR': batch 128, 200 epochs, inception crop to 224,
RandAugment, erasing, repeated and patch-wise augmentation, Resize(256) + CenterCrop(224)
evaluation); the paper's extra
DeepAugment images are not included. Paper (Table 1): RSPC-FAN-S-Hybrid 85.30% clean, 75.72%
mean CIFAR-100-C accuracy (FAN-S-Hybrid 84.92 / 74.19 = `:plain`).
Not reproduced by us. `:smoke`: a tiny FAN-Hybrid on the digits for a few steps on CPU.
"""

from rspc_jax.training import defaults, recipes


def get_config(arg=None):
    c = defaults.get_default_config()
    c.model_name = "fan_small_12_p4_hybrid"
    recipes.apply_cifar224_recipe(c, "cifar100")
    return recipes.select_variant(
        c,
        arg,
        smoke=lambda c: recipes.apply_smoke(
            c,
            "fan_small_12_p4_hybrid",
            dict(
                embed_dim=16,
                depth=2,
                num_heads=2,
                stem_depths=(1, 1),
                stem_dims=(8, 16),
                cls_attn_layers=1,
                drop_path_rate=0.1,
            ),
        ),
    )
