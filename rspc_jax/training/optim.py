"""The two optimizers of the RSPC min-max game (optax)."""

from flax import traverse_util
import jax.numpy as jnp
import optax


def schedule_for_run(config, *, batch_size: int, steps_per_epoch: int, total_steps: int):
    """The classifier's learning rate per step, as `config.schedule` names it: 'per_step'
    (the default, `learning_rate`) or 'official_epochs' (`official_epoch_learning_rate`)."""
    if config.schedule == "official_epochs":
        return official_epoch_learning_rate(
            config, batch_size=batch_size, steps_per_epoch=steps_per_epoch, total_steps=total_steps
        )
    return learning_rate(
        config,
        batch_size=batch_size,
        total_steps=total_steps,
        warmup_steps=int(config.warmup_epochs * steps_per_epoch),
        cooldown_steps=int(config.cooldown_epochs * steps_per_epoch),
    )


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


def official_epoch_learning_rate(
    config, *, batch_size: int, steps_per_epoch: int, total_steps: int
) -> optax.Schedule:
    """The official RVT/RSPC schedule: timm's CosineLRScheduler (warmup_prefix off, one
    cycle, no noise) stepped once per epoch by `lr_scheduler.step(epoch)` after epoch `epoch`.

    timm's value for epoch index t is `warmup_lr + t * (peak - warmup_lr) / warmup_epochs`
    while t < warmup_epochs, then `min_lr + (peak - min_lr) * (1 + cos(pi * t / T)) / 2` with
    T = the run's epochs less `cooldown_epochs` (the warm-up is not subtracted: the cosine
    starts below the peak), then `min_lr`. The scheduler sets value(0) when it is built and
    the loop steps it after each epoch with that epoch's index, so epoch e (from 0) trains at
    value(max(e - 1, 0)): epochs 0 and 1 share the first value. The lr is constant within an
    epoch; a run of `total_steps` spans total_steps / steps_per_epoch epochs.
    """
    peak = config.lr * batch_size / config.lr_base_batch
    cosine_epochs = max(total_steps / steps_per_epoch - config.cooldown_epochs, 1.0)
    warmup_epochs = config.warmup_epochs

    def schedule(step):
        t = jnp.maximum(step // steps_per_epoch - 1, 0).astype(jnp.float32)
        warming = config.warmup_lr + t * (peak - config.warmup_lr) / max(warmup_epochs, 1.0)
        cosine = config.min_lr + 0.5 * (peak - config.min_lr) * (
            1.0 + jnp.cos(jnp.pi * t / cosine_epochs)
        )
        after_warmup = jnp.where(t < cosine_epochs, cosine, config.min_lr)
        return jnp.where(t < warmup_epochs, warming, after_warmup)

    return schedule


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
