"""DeiT-S/16 with RSPC on ImageNet-1k at 224x224 (TPU v3-8 or larger).

    python -m rspc_jax.main --config=configs/deit_s_imagenet.py --workdir=gs://BUCKET/rspc/deit_s

Needs `imagenet2012` prepared in TFDS_DATA_DIR (README, "Datasets"). Recipe: DeiT's
(Touvron et al. 2021) as the official RSPC code runs it for RVT (rspc-method.md 12.1):
global batch 1024, AdamW lr 5e-4 x batch/512, 5 warm-up epochs from 1e-6, cosine to
1e-5 over 300 epochs, wd 0.05 (none on 1-D params, pos_embed, cls_token), drop path 0.1,
mixup 0.8 / cutmix 1.0 / smoothing 0.1, EMA, inception crop + flip; rho 0.1, lambda 0.005.
Published reference points (not measured by us): DeiT-S 79.8% top-1 (DeiT paper);
the RSPC paper reports RSPC on DeiT-Ti as +0.4 top-1 and -1.4 ImageNet-C mCE.
Not implemented yet, so this recipe differs from DeiT there: RandAugment, random
erasing and repeated augmentation. `:plain` trains the baseline without RSPC.
"""

from rspc_jax import config_defaults


def get_config(arg=None):
    c = config_defaults.get_default_config()
    c.model_name = "deit_small_patch16_224"
    c.model.drop_path_rate = 0.1
    config_defaults.apply_imagenet_recipe(c, batch_size=1024)
    # 0.99996 at the official global batch 2048, rescaled to keep the half-life in epochs.
    c.ema_decay = 0.99996 ** (1024 / 2048)
    c.log_every_steps = 100
    c.checkpoint_every_steps = 2500
    if arg == "plain":
        c.rspc.enabled = False
    elif arg not in (None, ""):
        raise ValueError(f"unknown variant {arg!r}; use 'plain'")
    return c
