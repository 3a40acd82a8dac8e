"""RVT-S* with RSPC on CIFAR100 at 224x224 (up-sampled), the paper's Table 1 setting.

    python -m rspc_jax.main --config=configs/cifar100_rvt_s.py --workdir=gs://BUCKET/rspc/cifar100_rvt_s

Needs `cifar100` prepared in TFDS_DATA_DIR (README, "Datasets"). `rvt_small_plus` from scratch
with the official EXP_CIFAR recipe, `rspc_jax.training.recipes.apply_cifar224_recipe`
(docs/method.md, 'Recipes: CIFAR': batch 128, 200 epochs, inception crop to 224,
RandAugment, erasing, repeated and patch-wise augmentation, Resize(256) + CenterCrop(224)
evaluation); the paper's extra
DeepAugment images are not included. Paper (Table 1): RSPC-RVT-S 84.81% clean, 74.94% mean
CIFAR-100-C accuracy (RVT-S 84.13 / 73.43 = `:plain`).
Not reproduced by us. `:smoke`: a tiny RVT* on the digits for a few steps on CPU.
"""

from rspc_jax.training import defaults, recipes


def get_config(arg=None):
    c = defaults.get_default_config()
    c.model_name = "rvt_small_plus"
    recipes.apply_cifar224_recipe(c, "cifar100")
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
