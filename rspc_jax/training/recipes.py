"""The recipes that configs in `configs/` share: each `apply_*` sets one published or
project recipe on a config from `defaults.get_default_config()`, in place, and
`select_variant` reads a config's `:<variant>` argument (its `get_config(arg)`) the same way
in every config."""

from collections.abc import Callable

import ml_collections

from rspc_jax.training import ablations


def apply_imagenet_recipe(
    c: ml_collections.ConfigDict, *, batch_size: int, per_device_batch: int
) -> None:
    """The DeiT/RVT ImageNet-1k recipe as RSPC_RVT runs it (docs/method.md, "Recipes: RVT"): 224 px
    inception crops (bicubic) + flip, RandAugment rand-m9-mstd0.5-inc1, random erasing 0.25,
    repeated augmentation x3, mixup 0.8 / cutmix 1.0, label smoothing 0.1, lr 5e-4 x
    batch/512, 5 warm-up epochs, cosine over 300 epochs then 10 cool-down epochs at min_lr
    (RSPC_RVT keeps timm's returned 310 epochs), drop path 0.1, EMA 0.99996.

    `per_device_batch` is the official per-GPU batch: the GradScaler's 2**16 scaled each
    GPU's mean loss, so C's gradient scale is 2**16 * batch_size / per_device_batch here.
    """
    c.dataset = "imagenet2012"
    c.image_size = 224
    c.augment = "imagenet"
    c.rand_augment = "rand-m9-mstd0.5-inc1"
    c.random_erase_prob = 0.25
    c.repeated_augment = 3
    c.batch_size = batch_size
    c.eval_batch_size = 1024
    c.num_epochs = 310
    c.optimizer.warmup_epochs = 5
    c.optimizer.cooldown_epochs = 10
    c.model.drop_path_rate = 0.1
    c.label_smoothing = 0.1
    c.mixup.mixup_alpha = 0.8
    c.mixup.cutmix_alpha = 1.0
    c.ema_decay = 0.99996
    c.rspc.corruption_grad_scale = 65536.0 * batch_size / per_device_batch
    c.log_every_steps = 100
    c.checkpoint_every_steps = 2500


def apply_fan_recipe(
    c: ml_collections.ConfigDict,
    *,
    batch_size: int,
    lr: float,
    warmup_epochs: float,
    drop_path_rate: float,
) -> None:
    """RSPC_FAN/train_script.sh (docs/method.md, "Recipes: FAN") on top of the ImageNet recipe: an
    absolute lr (FAN's main does not scale it), min lr 1e-6, random erasing 0.3, no
    repeated augmentation, EMA 0.99992, seed 42, per-GPU batch 128 (FAN-T) or 64."""
    apply_imagenet_recipe(
        c, batch_size=batch_size, per_device_batch=128 if batch_size <= 2048 else 64
    )
    c.optimizer.lr = lr
    c.optimizer.lr_base_batch = batch_size
    c.optimizer.warmup_epochs = warmup_epochs
    c.optimizer.min_lr = 1e-6
    c.random_erase_prob = 0.3
    c.repeated_augment = 1
    c.ema_decay = 0.99992
    c.seed = 42
    c.model.drop_path_rate = drop_path_rate


def apply_cifar224_recipe(c: ml_collections.ConfigDict, dataset: str) -> None:
    """EXP_CIFAR (docs/method.md, "Recipes: CIFAR"): CIFAR up-sampled to 224 px by the inception crop,
    evaluated with Resize(256) + CenterCrop(224), batch 128 (2 GPUs x 64), lr 5e-4 x
    128/512, 200 epochs without warm-up or cool-down, patch-wise augmentation on, and
    otherwise the ImageNet recipe. DeepAugment data is not included."""
    apply_imagenet_recipe(c, batch_size=128, per_device_batch=64)
    c.dataset = dataset
    c.eval_preprocess = "center_crop"
    c.eval_batch_size = 1000
    c.num_epochs = 200
    c.optimizer.warmup_epochs = 0
    c.optimizer.cooldown_epochs = 0
    c.patch_aug = "official"
    c.log_every_steps = 100
    c.checkpoint_every_steps = 2000


def apply_smoke(
    c: ml_collections.ConfigDict, model_name: str, model: dict, image_size: int = 32
) -> None:
    """A tiny member of the family for a few steps on the embedded digits (CPU, minutes);
    the augmentations of the recipe stay on, mixup and repeated augmentation go off."""
    c.model_name = model_name
    c.model = ml_collections.ConfigDict(model)
    c.dataset = "sklearn_digits"
    c.augment = "digits"
    c.eval_preprocess = ""
    c.image_size = image_size
    c.batch_size = 8
    c.eval_batch_size = 304
    c.total_steps = 3
    c.log_every_steps = 1
    c.repeated_augment = 1
    c.mixup.mixup_alpha = 0.0
    c.mixup.cutmix_alpha = 0.0


def apply_adversarial_recipe(c: ml_collections.ConfigDict, eps: float = 4 / 255) -> None:
    """The adversarial-training switches of Debenedetti's thesis ("Adversarially Robust Vision
    Transformers", EPFL 2022): FGSM at `eps` (pixels in [0, 1]) warmed up over 10 epochs, the
    attack seeing the model in train mode, FGSM evals at `eps` choosing the state kept in
    <workdir>/best; RSPC off."""
    c.rspc.enabled = False
    c.adversarial.method = "fgsm"
    c.adversarial.eps = eps
    c.adversarial.eps_warmup_epochs = 10
    c.adversarial.attack_bn = "train"
    c.eval_fgsm_eps = eps
    c.keep_best = "fgsm_accuracy"


def apply_thesis_imagenet_recipe(c: ml_collections.ConfigDict) -> None:
    """The thesis's tuned ImageNet-1k recipe (4.1-4.2; configs/xcit_s12_adv.py): batch 512,
    lr 5e-4 x batch/512, 110 epochs (5 warm-up from 5e-6, cosine to 5e-5, 10 cool-down),
    weight decay 0.5, basic augmentation (random resized crop, flip, colour jitter 0.4)
    and `apply_adversarial_recipe` at 4/255."""
    c.dataset = "imagenet2012"
    c.image_size = 224
    c.augment = "imagenet"
    c.color_jitter = 0.4
    c.batch_size = 512
    c.eval_batch_size = 1024
    c.num_epochs = 110
    c.optimizer.update(
        dict(
            lr=5e-4,
            lr_base_batch=512,
            warmup_epochs=5,
            warmup_lr=5e-6,
            min_lr=5e-5,
            cooldown_epochs=10,
            weight_decay=0.5,
        )
    )
    c.log_every_steps = 100
    c.checkpoint_every_steps = 2500
    apply_adversarial_recipe(c)


def apply_digits_demo(c: ml_collections.ConfigDict) -> None:
    """The embedded demo (configs/demo.py; the base of configs/demo_study.py): a 4-block ViT
    with 4x4 tokens of 8 px on the digits up-sampled to 32 px, 40 epochs of batch 64."""
    c.model_name = "vit_demo"
    # Listed so that `--config.model.<field>=...` can override them.
    c.model = dict(patch_size=8, width=96, depth=4, num_heads=4, mlp_ratio=4.0, drop_path_rate=0.1)
    c.dataset = "sklearn_digits"
    c.image_size = 32
    c.augment = "digits"
    c.batch_size = 64
    c.eval_batch_size = 304  # 297 test images in one padded batch
    c.num_epochs = 40
    c.label_smoothing = 0.1
    c.optimizer.lr = 1.6e-2  # peak lr 2e-3 after the DeiT scaling (x 64/512)
    c.optimizer.warmup_epochs = 2
    c.log_every_steps = 50
    c.eval_every_steps = 115  # every 5 epochs
    c.checkpoint_every_steps = 230
    # Four steps per compiled call between log, eval and checkpoint steps: the same run
    # (equal evaluations at every eval step) with one dispatch, and on CPU one mapping of the
    # step's temporaries, per four steps.
    c.steps_per_call = 4
    # Robustness report (`python -m rspc_jax.evaluate --config=configs/demo.py`): the
    # protocols' settings, with the attacks on the first 100 test digits so that the whole
    # report takes minutes on 2 CPU cores.
    c.evaluation.adversarial_examples = 100
    # Analyses (`python -m rspc_jax.analyze --config=configs/demo.py`): the grid attack's
    # +-16 px at 224 px is 7% of the image; +-4 px (1 px steps) is 12% of the 32 px digits.
    c.analysis.max_translation = 4.0


def apply_digits_demo_smoke(c: ml_collections.ConfigDict) -> None:
    """A few steps of a 2-block demo (configs/demo.py:smoke, used by the tests)."""
    c.model.depth = 2
    c.model.width = 32
    c.model.num_heads = 2
    c.total_steps = 6
    c.log_every_steps = 2
    c.eval_every_steps = 6
    c.checkpoint_every_steps = 3
    c.steps_per_call = 1  # one compile per test run


def select_variant(
    c: ml_collections.ConfigDict,
    arg: str | None,
    **variants: Callable[[ml_collections.ConfigDict], None],
) -> ml_collections.ConfigDict:
    """Applies the variant `arg` of a config (`--config=configs/<name>.py:<arg>`) to the config
    as written, `c`, in place, and returns it. `arg` is one of:

    - '' (or None): the config as written;
    - a name of `variants`, the config's own (each a function that changes `c`): 'smoke', a
      tiny member of the family for a few steps on the digits, or a model size;
    - 'plain': the same without RSPC (the paper's baseline row), for a config that trains with
      RSPC;
    - a name of `rspc_jax.training.ablations`: one of the paper's ablations or
      adversarial-training baselines (README, "Baselines and ablations").
    """
    arg = arg or ""
    if arg in variants:
        variants[arg](c)
    elif arg == "plain" and c.rspc.enabled:
        c.rspc.enabled = False
    elif arg in ablations.ABLATIONS:
        ablations.apply(c, arg)
    elif arg:
        own = sorted(variants) + (["plain"] if c.rspc.enabled else [])
        raise ValueError(
            f"unknown variant {arg!r}; use {', '.join(map(repr, own + ['']))} or an ablation "
            f"of rspc_jax/training/ablations.py ({', '.join(sorted(ablations.ABLATIONS))})"
        )
    return c
