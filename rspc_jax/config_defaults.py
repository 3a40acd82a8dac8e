"""Defaults shared by every config in `configs/` (which import and override them)."""

import ml_collections


def get_default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0

    # Model: any name in `rspc_jax.models.names()`; `model` holds constructor overrides.
    c.model_name = "vit_demo"
    c.model = ml_collections.ConfigDict()
    # BatchNorm batch statistics over all devices instead of per device (official: per GPU).
    c.bn_cross_device = False

    # Data (tfds builder names; TFDS_DATA_DIR or `data_dir` says where prepared data lives).
    c.dataset = "sklearn_digits"
    c.data_dir = ml_collections.config_dict.placeholder(str)
    c.train_split = ml_collections.config_dict.placeholder(str)  # default: the dataset's
    c.eval_split = ml_collections.config_dict.placeholder(str)
    c.image_size = 32
    c.augment = "digits"          # 'digits' | 'cifar' | 'imagenet' | 'none'
    c.shuffle_buffer = 10_000

    # Schedule. `batch_size` is global (all devices of all hosts).
    c.batch_size = 128
    c.eval_batch_size = 256
    c.num_epochs = 30.0
    c.total_steps = 0              # > 0 overrides num_epochs

    c.optimizer = ml_collections.ConfigDict(dict(
        lr=5e-4,                   # peak lr = lr * batch_size / lr_base_batch (DeiT)
        lr_base_batch=512,
        warmup_epochs=5.0,
        warmup_lr=1e-6,
        min_lr=1e-5,
        b1=0.9, b2=0.999, eps=1e-8,
        weight_decay=0.05,
    ))
    c.label_smoothing = 0.0
    # Mixup/CutMix (off when both alphas are 0). DeiT/RVT: 0.8 / 1.0, smoothing 0.1.
    c.mixup = ml_collections.ConfigDict(dict(
        mixup_alpha=0.0, cutmix_alpha=0.0, prob=1.0, switch_prob=0.5))
    c.ema_decay = 0.0              # per-step decay of a classifier EMA; 0 = off

    # RSPC (defaults = the official code; see rspc_jax/rspc.py).
    c.rspc = ml_collections.ConfigDict(dict(
        enabled=True,
        rho=0.1,                   # fraction of patches occluded
        lam=0.005,                 # weight of the alignment loss
        patch_size=0,              # 0 = the model's patch size
        ste="clip",                # 'clip' (hardtanh backward, official) | 'identity'
        # Emulates the GradScaler's 2**16 on C's gradient (1 = paper). It scales the gradient
        # of the global-mean loss; official runs scaled each GPU's mean loss, so emulating
        # per-GPU batch b needs 2**16 * batch_size / b.
        occ_grad_scale=65536.0,
        noise_space="normalized",  # 'normalized' (official) | 'pixel' (U[0,1) pixels, as the paper words it)
        clamp="imagenet",          # 'imagenet' (official, even on CIFAR) | 'dataset' | 'none'
        selection="learned",       # 'learned' | 'random' (Table 3 ablation)
        align_blocks=(),           # () = all backbone blocks
        optimizer=ml_collections.ConfigDict(dict(
            lr=1e-4, momentum=0.9, nesterov=True, weight_decay=0.05, clip_norm=5.0)),
    ))

    # Loop.
    c.log_every_steps = 50
    c.eval_every_steps = 0         # 0 = once per epoch
    c.checkpoint_every_steps = 500
    c.keep_checkpoints = 3
    c.block_each_step = "auto"     # 'auto' (block on CPU, where queued collectives deadlock) | 'yes' | 'no'
    c.distributed = "auto"         # jax.distributed.initialize: 'auto' | 'yes' | 'no'
    return c


def apply_imagenet_recipe(c: ml_collections.ConfigDict, batch_size: int) -> None:
    """The DeiT/RVT ImageNet-1k recipe shared by the ImageNet configs (rspc-method.md 12.1):
    224 px inception crops, 300 epochs, 5 warm-up epochs, mixup 0.8 / cutmix 1.0,
    label smoothing 0.1, lr 5e-4 x batch/512 (the default optimizer)."""
    c.dataset = "imagenet2012"
    c.image_size = 224
    c.augment = "imagenet"
    c.batch_size = batch_size
    c.eval_batch_size = 1024
    c.num_epochs = 300
    c.optimizer.warmup_epochs = 5
    c.label_smoothing = 0.1
    c.mixup.mixup_alpha = 0.8
    c.mixup.cutmix_alpha = 1.0
