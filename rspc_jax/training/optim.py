"""The two optimizers of the RSPC min-max game (optax)."""

from flax import traverse_util
import optax


def learning_rate(
    config, *, batch_size: int, warmup_steps: int, total_steps: int, cooldown_steps: int = 0
) -> optax.Schedule:
    """Linear warm-up from `warmup_lr`, cosine to `min_lr`, then `cooldown_steps` at
    `min_lr` (timm's cool-down epochs), per step.

    The peak is `lr * batch_size / lr_base_batch` (DeiT's linear scaling rule) for the
    global `batch_size`; configs with an absolute lr (FAN) set lr_base_batch = batch_size.
    """
    peak = config.lr * batch_size / config.lr_base_batch
    cosine_steps = max(total_steps - cooldown_steps, 1)
    warmup = min(warmup_steps, cosine_steps - 1)
    cosine = optax.warmup_cosine_decay_schedule(
        init_value=config.warmup_lr,
        peak_value=peak,
        warmup_steps=warmup,
        decay_steps=max(cosine_steps, warmup + 1),
        end_value=config.min_lr,
    )
    if cooldown_steps <= 0:
        return cosine
    return optax.join_schedules(
        [cosine, optax.constant_schedule(config.min_lr)], boundaries=[cosine_steps]
    )


def weight_decay_mask(params, no_decay_names=()):
    """timm's param groups: no decay for 1-D params (biases, norms) and named ones."""
    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict(
        {path: leaf.ndim > 1 and path[-1] not in no_decay_names for path, leaf in flat.items()}
    )


def classifier_optimizer(
    config, schedule, params, no_decay_names=()
) -> optax.GradientTransformation:
    """AdamW (timm defaults) with decoupled decay masked off 1-D and named params."""
    return optax.adamw(
        schedule,
        b1=config.b1,
        b2=config.b2,
        eps=config.eps,
        weight_decay=config.weight_decay,
        mask=weight_decay_mask(params, no_decay_names),
    )
