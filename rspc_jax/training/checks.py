"""Checks of a run config and workdir that need neither JAX nor TensorFlow, so that
`rspc_jax.main` rejects bad input in a second, before the heavy imports and any compile.

Every numeric field is checked against its meaning; the message names the field, its
value, the valid range and why. Checks that need the devices or the data (batch size
divisible by the device count, the dataset's size) run later, still before compiling.
"""

from collections.abc import Callable
import dataclasses
import math
import os
import uuid

import ml_collections

from rspc_jax import ConfigError

# Values of the string switches (rspc_jax.training.adversarial.METHODS mirrors "method").
CHOICES = {
    "optimizer.schedule": ("per_step", "official_epochs"),
    "rspc.ste": ("clip", "identity"),
    "rspc.noise_space": ("normalized", "pixel"),
    "rspc.clamp": ("imagenet", "dataset", "none"),
    "rspc.selection": ("learned", "random", "random_object", "attended", "random_attended"),
    "rspc.corruption_model": ("official", "content"),
    "rspc.objective": ("align", "ce"),
    "rspc.fill": ("noise", "zero", "drop"),
    "adversarial.method": ("none", "fgsm", "pgd", "trades"),
    "adversarial.attack_bn": ("train", "eval"),
    "block_each_step": ("auto", "yes", "no"),
    "transfer_guard": ("allow", "log", "disallow"),
    "compute_dtype": ("float32", "bfloat16"),
    "sharding": ("replicated", "fsdp"),
    "patch_aug": ("off", "official", "intended"),
    "init_head": ("load", "reset"),
    "keep_best": ("", "accuracy", "fgsm_accuracy"),
}


@dataclasses.dataclass(frozen=True)
class Range:
    """The valid values of one numeric field and what it means."""

    test: Callable[[float], bool]
    valid: str  # "> 0", "in [0, 1)", ...
    meaning: str


def _positive(v):
    return v > 0


def _non_negative(v):
    return v >= 0


def _fraction(v):  # [0, 1)
    return 0 <= v < 1


def _probability(v):  # [0, 1]
    return 0 <= v <= 1


def _open_unit(v):  # (0, 1)
    return 0 < v < 1


def _at_least_one(v):
    return v >= 1


_INTEGER = (
    "batch_size",
    "eval_batch_size",
    "image_size",
    "total_steps",
    "steps_per_call",
    "repeated_augment",
    "adversarial.steps",
    "evaluation.occlusion_masks",
    "evaluation.occlusion_every_mask_limit",
)
_INTEGER_SUFFIXES = ("_steps", "_every_steps", "keep_checkpoints", "shuffle_buffer")

RANGES = {
    "image_size": Range(_positive, "> 0", "the training and evaluation resolution in pixels"),
    "batch_size": Range(_positive, "> 0", "the global batch of all devices and hosts"),
    "grad_accum_steps": Range(
        _at_least_one, ">= 1", "micro-batches per optimizer step; 1 = no accumulation"
    ),
    "steps_per_call": Range(
        _at_least_one, ">= 1", "train steps per compiled call; 1 = one step per call"
    ),
    "eval_batch_size": Range(_positive, "> 0", "the global evaluation batch"),
    "num_epochs": Range(_positive, "> 0", "epochs to train (unless total_steps > 0)"),
    "total_steps": Range(_non_negative, ">= 0", "steps to train; 0 = num_epochs"),
    "shuffle_buffer": Range(_at_least_one, ">= 1", "examples in tf.data's shuffle buffer"),
    "repeated_augment": Range(_at_least_one, ">= 1", "DeiT's repeated augmentation; 1 = off"),
    "random_erase_prob": Range(_probability, "in [0, 1]", "a probability"),
    "color_jitter": Range(_non_negative, ">= 0", "ColorJitter strength; 0 = off"),
    "label_smoothing": Range(_fraction, "in [0, 1)", "the probability mass moved off the label"),
    "ema_decay": Range(_fraction, "in [0, 1)", "the per-step EMA decay; 0 = off"),
    "optimizer.lr": Range(
        _positive, "> 0", "the learning rate; a negative one trains by gradient ascent"
    ),
    "optimizer.lr_base_batch": Range(_positive, "> 0", "the batch the lr is given for"),
    "optimizer.warmup_epochs": Range(_non_negative, ">= 0", "linear warm-up length"),
    "optimizer.cooldown_epochs": Range(_non_negative, ">= 0", "epochs at min_lr at the end"),
    "optimizer.warmup_lr": Range(_non_negative, ">= 0", "the lr the warm-up starts from"),
    "optimizer.min_lr": Range(_non_negative, ">= 0", "the lr the cosine ends at"),
    "optimizer.b1": Range(_fraction, "in [0, 1)", "Adam's first-moment decay"),
    "optimizer.b2": Range(_fraction, "in [0, 1)", "Adam's second-moment decay"),
    "optimizer.eps": Range(_positive, "> 0", "Adam's denominator epsilon"),
    "optimizer.weight_decay": Range(_non_negative, ">= 0", "decoupled weight decay"),
    "mixup.mixup_alpha": Range(_non_negative, ">= 0", "Mixup's Beta parameter; 0 = off"),
    "mixup.cutmix_alpha": Range(_non_negative, ">= 0", "CutMix's Beta parameter; 0 = off"),
    "mixup.prob": Range(_probability, "in [0, 1]", "the probability of mixing a batch"),
    "mixup.switch_prob": Range(_probability, "in [0, 1]", "the probability of CutMix over Mixup"),
    "model.mlp_ratio": Range(_positive, "> 0", "the MLP's hidden width over the token width"),
    "model.drop_path_rate": Range(_fraction, "in [0, 1)", "the deepest block's drop-path rate"),
    "model.dropout": Range(_fraction, "in [0, 1)", "a dropout probability"),
    "rspc.rho": Range(_open_unit, "in (0, 1)", "the fraction of patches occluded; paper: 0.1"),
    "rspc.temperature": Range(
        _non_negative, ">= 0", "the Gumbel top-k temperature of C's masks; 0 = C's top-k"
    ),
    "rspc.learned_fraction": Range(
        _probability, "in [0, 1]", "the share of the occluded patches C picks; 1 = official"
    ),
    "rspc.learned_fraction_ramp_epochs": Range(
        _non_negative, ">= 0", "epochs over which C's share ramps up from 0; 0 = none"
    ),
    "rspc.learned_batch_fraction": Range(
        _probability, "in [0, 1]", "the share of each batch masked by C; 1 = official"
    ),
    "rspc.corruption_warmup_epochs": Range(
        _non_negative, ">= 0", "epochs before C starts to learn; 0 = official"
    ),
    "rspc.corruption_curriculum_epochs": Range(
        _non_negative, ">= 0", "epochs over which C turns from helping to adversarial; 0 = none"
    ),
    "rspc.corruption_diversity": Range(
        _non_negative, ">= 0", "the weight of C's batch diversity term; 0 = official"
    ),
    "rspc.attended_pool": Range(
        _at_least_one, ">= 1", "m / k: k patches drawn among the m most attended; 1 = the top k"
    ),
    "rspc.lam": Range(_non_negative, ">= 0", "the alignment loss weight lambda; paper: 0.005"),
    "rspc.patch_size": Range(_non_negative, ">= 0", "C's patch in pixels; 0 = the model's"),
    "rspc.corruption_grad_scale": Range(_positive, "> 0", "the scale of C's STE gradient"),
    "rspc.optimizer.lr": Range(_positive, "> 0", "C's learning rate (it ascends)"),
    "rspc.optimizer.momentum": Range(_fraction, "in [0, 1)", "C's SGD momentum"),
    "rspc.optimizer.weight_decay": Range(_non_negative, ">= 0", "C's L2 weight decay"),
    "rspc.optimizer.clip_norm": Range(_positive, "> 0", "C's gradient-norm clip"),
    "adversarial.eps": Range(
        lambda v: 0 < v <= 1, "in (0, 1]", "the L-inf budget, pixels in [0, 1] (e.g. 4/255)"
    ),
    "adversarial.steps": Range(_at_least_one, ">= 1", "attack steps"),
    "adversarial.step_size": Range(_non_negative, ">= 0", "the attack step; 0 = its default"),
    "adversarial.beta": Range(_non_negative, ">= 0", "TRADES' KL weight"),
    "adversarial.eps_warmup_epochs": Range(_non_negative, ">= 0", "eps warm-up length"),
    "eval_fgsm_eps": Range(_probability, "in [0, 1]", "FGSM eps of the evals; 0 = off"),
    "log_every_steps": Range(_at_least_one, ">= 1", "steps between metric logs"),
    "eval_every_steps": Range(_non_negative, ">= 0", "steps between evals; 0 = each epoch"),
    "checkpoint_every_steps": Range(_at_least_one, ">= 1", "steps between checkpoints"),
    "keep_checkpoints": Range(_at_least_one, ">= 1", "checkpoints kept"),
    "evaluation.occlusion_rho": Range(_open_unit, "in (0, 1)", "the occluded fraction"),
    "evaluation.occlusion_masks": Range(_at_least_one, ">= 1", "random masks per image"),
    "evaluation.occlusion_every_mask_limit": Range(
        _non_negative, ">= 0", "the most masks tried exhaustively; 0 = none"
    ),
}


# The models' architecture fields that `config.model` may override (each model has some):
# whole numbers >= 1, or per stage a tuple of them (RVT's depth, heads and base_dims, Swin's
# depths and num_heads); mlp_ratio is in RANGES.
ARCHITECTURE = {
    "depth": "the number of transformer blocks (of each stage, for RVT)",
    "depths": "the number of blocks of each stage",
    "width": "the token width",
    "embed_dim": "the token width",
    "base_dims": "the width per attention head of each stage",
    "num_heads": "the number of attention heads (of each stage, for Swin)",
    "heads": "the number of attention heads of each stage",
    "patch_size": "the token's patch in pixels",
    "embed_patch_size": "the token's patch in pixels",
    "hybrid_patch_size": "the patch of the convolutional stem's output",
    "window_size": "the attention window in tokens",
}


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_architecture(model) -> None:
    """Each architecture field of `model` (config.model) can build a model: a model of
    depth 0 would fail only when traced, with a KeyError."""
    for name, meaning in ARCHITECTURE.items():
        value = model.get(name)
        if value is None:
            continue
        values = tuple(value) if isinstance(value, (tuple, list)) else (value,)
        if not values or not all(map(_is_count, values)):
            raise ConfigError(
                f"config.model.{name}={value!r} cannot build a model: {meaning} must be a "
                f"whole number >= 1. Fix it in the config file or pass "
                f"--config.model.{name}=<value>."
            )
    for width in ("width", "embed_dim"):
        heads = model.get("num_heads")
        if _is_count(model.get(width)) and _is_count(heads) and model[width] % heads:
            raise ConfigError(
                f"config.model.{width}={model[width]} is not divisible by config.model."
                f"num_heads={heads}: each attention head gets an equal share of the token "
                "width; pick a width that is a multiple of the heads."
            )


def _get(config, dotted: str):
    """The value at `dotted`, or None where the config has no such field (model overrides)."""
    for part in dotted.split("."):
        if not isinstance(config, (ml_collections.ConfigDict, dict)) or part not in config:
            return None
        config = config[part]
    return config


def _is_integer_field(name: str) -> bool:
    return name in _INTEGER or name.endswith(_INTEGER_SUFFIXES)


def _check_number(name: str, value, valid_range: Range) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(
            f"config.{name}={value!r} is not a number: must be {valid_range.valid} "
            f"({valid_range.meaning})."
        )
    if _is_integer_field(name) and int(value) != value:
        raise ConfigError(f"config.{name}={value!r} must be a whole number.")
    if not math.isfinite(value) or not valid_range.test(value):
        raise ConfigError(
            f"config.{name}={value!r} is out of range: must be {valid_range.valid} "
            f"({valid_range.meaning}). Fix it in the config file or pass --config.{name}=<value>."
        )


def validate_config(config: ml_collections.ConfigDict) -> None:
    """Raises ConfigError naming the first field whose value cannot work."""
    for name, choices in CHOICES.items():
        value = _get(config, name)
        if value not in choices:
            raise ConfigError(
                f"config.{name}={value!r} is not one of {', '.join(map(repr, choices))}."
            )
    for name, valid_range in RANGES.items():
        value = _get(config, name)
        if value is not None:
            _check_number(name, value, valid_range)
    _check_architecture(config.get("model") or {})
    opt = config.optimizer
    # With total_steps > 0 (a truncated run) the schedule clips the warm-up to the run.
    if not config.total_steps and opt.warmup_epochs + opt.cooldown_epochs >= config.num_epochs:
        raise ConfigError(
            f"config.optimizer.warmup_epochs={opt.warmup_epochs} plus cooldown_epochs="
            f"{opt.cooldown_epochs} leave no epoch of the {config.num_epochs} to train for the "
            "cosine schedule; shorten the warm-up or train longer."
        )
    if config.batch_size % config.grad_accum_steps:
        raise ConfigError(
            f"config.batch_size={config.batch_size} is not divisible by "
            f"config.grad_accum_steps={config.grad_accum_steps}: each optimizer step splits "
            "the global batch into that many equal micro-batches; use a divisor of the batch."
        )
    if config.rspc.enabled and config.adversarial.method != "none":
        raise ConfigError(
            f"config.adversarial.method={config.adversarial.method!r} is a baseline "
            "that replaces RSPC; set config.rspc.enabled=False"
        )
    if config.keep_best == "fgsm_accuracy" and config.eval_fgsm_eps <= 0:
        raise ConfigError("config.keep_best='fgsm_accuracy' needs config.eval_fgsm_eps > 0")


def check_workdir(workdir: str) -> None:
    """A local workdir is a directory this process can create and write into (gs:// and other
    remote paths need TensorFlow's filesystems: `training.loop.resolve_workdir` writes and
    removes a test file there before anything is built)."""
    if "://" in workdir:
        return
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ConfigError(f"--workdir {workdir} is a file, not a directory; pass a directory.")
    try:
        os.makedirs(workdir, exist_ok=True)
        probe = os.path.join(workdir, f".write-test-{uuid.uuid4().hex}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as error:
        raise ConfigError(
            f"cannot write into --workdir {workdir}: {error.strerror or error}. Pass a "
            "directory you can write to (or fix its permissions / free disk space)."
        ) from error
