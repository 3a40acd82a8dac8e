"""XCiT-S12/16 with RSPC on ImageNet-1k at 224x224 (TPU v3-8 or larger).

    python -m rspc_jax.main --config=configs/xcit_s12.py --workdir=gs://BUCKET/rspc/xcit_s12

Needs `imagenet2012` prepared in TFDS_DATA_DIR (README, "Datasets"). The RSPC paper has
no XCiT run; this is the DeiT/RVT recipe of the other RSPC configs (docs/method.md, 'Recipes: RVT':
batch 1024 here, lr 5e-4 x batch/512, 300 + 10 cool-down epochs, RandAugment, random
erasing 0.25, repeated augmentation x3, mixup/cutmix, EMA) with XCiT-S12's drop path
0.05 (XCiT paper; it trains 400 epochs). RSPC aligns the 12 XCA blocks, not the
class-attention blocks. Reference point (not measured by us): XCiT-S12/16 82.0% top-1
(XCiT paper, 224 px, no distillation). `:plain` is the baseline; `:smoke` a 2-block XCiT
on the digits.
"""

from rspc_jax.training import defaults, recipes


def get_config(arg=None):
    c = defaults.get_default_config()
    c.model_name = "xcit_small_12_p16_224"
    recipes.apply_imagenet_recipe(c, batch_size=1024, per_device_batch=128)
    c.model.drop_path_rate = 0.05
    c.ema_decay = 0.99996 ** (1024 / 2048)
    return recipes.select_variant(
        c,
        arg,
        smoke=lambda c: recipes.apply_smoke(
            c,
            "xcit_small_12_p16_224",
            dict(embed_dim=16, depth=2, num_heads=2, cls_attn_layers=1, drop_path_rate=0.05),
        ),
    )
