"""Swin-T with RSPC on ImageNet-1k at 224x224 (TPU v3-8 or larger): the RSPC paper's
supplementary experiment (Sec. 4, "Effect of RSPC on diverse architectures").

    python -m rspc_jax.main --config=configs/swin_t.py --workdir=gs://BUCKET/rspc/swin_t

Needs `imagenet2012` prepared in TFDS_DATA_DIR (README, "Datasets"). The paper states no
recipe for Swin (its details are in a supplementary we do not have), so this is Swin's own
ImageNet-1k recipe (Liu et al. 2021, as its official config runs it) with RSPC's defaults
on top: global batch 1024 (128 per GPU), AdamW lr 5e-4 x 1024/512 = 1e-3, 20 warm-up
epochs from 1e-6, cosine to 1e-5 over 300 epochs (Swin scales both ends with the batch as
the peak; no cool-down), weight decay 0.05 (none on 1-D params and the relative position
bias tables), drop path 0.2, RandAugment rand-m9-mstd0.5-inc1, random erasing 0.25,
mixup 0.8 / cutmix 1.0, label smoothing 0.1, no repeated augmentation, no EMA; rho 0.1,
lambda 0.005 on the 16 px corruption grid (docs/models.md, 'Swin'). Swin also clips
gradients to norm 5, which this trainer's classifier optimizer has no switch for.
Reference (not measured by us): Swin-T 81.2% top-1 (Swin paper); the RSPC paper reports
ImageNet-C mCE 62.0 -> 61.0 with RSPC. `:plain` is the baseline; `:smoke` a two-stage Swin
on the digits.
"""

from rspc_jax.training import defaults, recipes


def get_config(arg=None):
    c = defaults.get_default_config()
    c.model_name = "swin_tiny_patch4_window7_224"
    recipes.apply_imagenet_recipe(c, batch_size=1024, per_device_batch=128)
    c.num_epochs = 300
    c.optimizer.update(
        dict(
            lr=5e-4,
            lr_base_batch=512,
            warmup_epochs=20,
            cooldown_epochs=0,
            # Swin scales its warm-up start and final lr with the batch, as the peak.
            warmup_lr=5e-7 * 1024 / 512,
            min_lr=5e-6 * 1024 / 512,
        )
    )
    c.model.drop_path_rate = 0.2
    c.repeated_augment = 1
    c.ema_decay = 0.0
    return recipes.select_variant(
        c,
        arg,
        smoke=lambda c: recipes.apply_smoke(
            c,
            "swin_tiny_patch4_window7_224",
            dict(embed_dim=16, depths=(2, 1), num_heads=(1, 2), window_size=4),
        ),
    )
