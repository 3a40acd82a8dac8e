"""ViT-S/4 with RSPC on CIFAR-10 at 32x32, with the paper's CIFAR optimisation recipe.

    python -m rspc_jax.main --config=configs/cifar10_vit_s.py --workdir=gs://BUCKET/rspc/cifar10_vit_s

Needs `cifar10` prepared in TFDS_DATA_DIR (README, "Datasets"). Recipe as
EXP_CIFAR of the official code (docs/method.md, 'Recipes: CIFAR'): global batch 128, AdamW lr
5e-4 x 128/512, no warm-up, cosine to 1e-5 over 200 epochs, wd 0.05, drop path 0.1,
mixup 0.8 / cutmix 1.0 / smoothing 0.1, EMA 0.99996, rho 0.1, lambda 0.005. Differences
from the paper's runs (configs/cifar10_rvt_s.py has them): the paper trains RVT-S / FAN-S
at 224 px (up-sampled CIFAR) with RandAugment, random erasing, repeated augmentation,
patch-wise augmentation and DeepAugment data; this config trains a ViT-S at the native
32 px with crop+flip only, a cheap 32 px baseline. Not measured by us yet: no accuracy is
claimed. Variants: `:plain` (no RSPC), `:smoke` (a few steps of a tiny model).
"""

from rspc_jax.training import defaults, recipes


def get_config(arg=None):
    c = defaults.get_default_config()
    c.model_name = "vit_small"
    c.model.patch_size = 4
    c.model.drop_path_rate = 0.1
    c.dataset = "cifar10"
    c.image_size = 32
    c.augment = "cifar"
    c.batch_size = 128
    c.eval_batch_size = 1000
    c.num_epochs = 200
    c.optimizer.lr = 5e-4
    c.optimizer.warmup_epochs = 0
    c.label_smoothing = 0.1
    c.mixup.mixup_alpha = 0.8
    c.mixup.cutmix_alpha = 1.0
    c.ema_decay = 0.99996
    c.log_every_steps = 100
    c.checkpoint_every_steps = 2000
    return recipes.select_variant(c, arg, smoke=_smoke)


def _smoke(c):
    """A few steps of a 1-block ViT at batch 16."""
    c.model_name = "vit_demo"
    c.model = {"patch_size": 4, "depth": 1, "width": 32, "num_heads": 2}
    c.batch_size = 16
    c.eval_batch_size = 16
    c.total_steps = 4
    c.log_every_steps = 2
