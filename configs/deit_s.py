"""DeiT-S/16 with RSPC on ImageNet-1k at 224x224 (TPU v3-8 or larger).

    python -m rspc_jax.main --config=configs/deit_s.py --workdir=gs://BUCKET/rspc/deit_s

Needs `imagenet2012` prepared in TFDS_DATA_DIR (README, "Datasets"). DeiT's recipe
(Touvron et al. 2021) as the official RSPC_RVT code runs it (docs/method.md, 'Recipes: RVT'): global
batch 1024 (128 per GPU), AdamW lr 5e-4 x 1024/512, 5 warm-up epochs, cosine over 300 +
10 cool-down epochs, wd 0.05 (none on 1-D params, pos_embed, cls_token), drop path 0.1,
RandAugment, random erasing 0.25, repeated augmentation x3, mixup/cutmix/smoothing, EMA;
rho 0.1, lambda 0.005. Published reference points (not measured by us): DeiT-S 79.8%
top-1 (DeiT paper); the RSPC paper reports RSPC on DeiT-Ti as +0.4 top-1 and -1.4
ImageNet-C mCE. `:plain` is the baseline; `:smoke` a 2-block DeiT on the digits.
"""

from rspc_jax.training import defaults, recipes


def get_config(arg=None):
    c = defaults.get_default_config()
    c.model_name = "deit_small_patch16_224"
    recipes.apply_imagenet_recipe(c, batch_size=1024, per_device_batch=128)
    # 0.99996 at the official global batch 2048, rescaled to keep the half-life in epochs.
    c.ema_decay = 0.99996 ** (1024 / 2048)
    return recipes.select_variant(
        c,
        arg,
        smoke=lambda c: recipes.apply_smoke(
            c, "deit_small_patch16_224", dict(width=32, depth=2, num_heads=2, patch_size=8)
        ),
    )
