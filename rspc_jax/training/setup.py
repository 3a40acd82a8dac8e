"""What a run config resolves to before training: checked settings, the model, the
step's static settings, the optimizers and the jitted sharded train step."""

from collections.abc import Callable
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import ml_collections

from rspc_jax import ConfigError, models, parallel, rspc
from rspc_jax.data import on_device
from rspc_jax.data import options as data_options
from rspc_jax.data import specs as datasets
from rspc_jax.training import adversarial as adversarial_training
from rspc_jax.training import checks, optim
from rspc_jax.training import step as train_step_lib


def validate_config(config: ml_collections.ConfigDict) -> None:
    """Fails on bad settings before anything is built or compiled: every field's range
    (checks.validate_config), then what needs the devices or files."""
    checks.validate_config(config)
    rspc.check_dataset(config.rspc, datasets.dataset_spec(config.dataset), config.dataset)
    parallel.check_batch_size(config.batch_size)
    per_device = config.batch_size // jax.device_count()
    if per_device % config.grad_accum_steps:
        raise ConfigError(
            f"config.grad_accum_steps={config.grad_accum_steps} does not divide the "
            f"{per_device} images per device (global batch_size={config.batch_size} over "
            f"{jax.device_count()} devices); every device splits its batch into equal "
            "micro-batches, so pick a divisor of the per-device batch."
        )
    parallel.check_batch_size(config.eval_batch_size, "eval_batch_size")
    try:
        data_options.check_augmentation(
            rand_augment=config.rand_augment,
            random_erase_prob=config.random_erase_prob,
            repeated_augment=config.repeated_augment,
            eval_preprocess=config.eval_preprocess,
        )
    except ValueError as error:
        raise ConfigError(f"bad augmentation setting in the config: {error}") from None
    if config.init_from and not _exists(config.init_from):
        raise ConfigError(
            f"config.init_from: checkpoint {config.init_from} does not exist; pass the path of "
            "a .pth/.safetensors/.npz file"
        )


def _exists(path: str) -> bool:
    """tf.io.gfile also sees gs:// paths; TF loads here, not with the module, so that
    timing or planning a step never holds TF's host memory."""
    import tensorflow as tf

    return tf.io.gfile.exists(path)


def build_model(config, num_classes: int):
    """The run's model for the train step (BatchNorm over the data axis if configured)."""
    return models.from_config(config, num_classes, bn_axis_name=parallel.DATA_AXIS)


def check_model_fits(config, model) -> None:
    """The image size divides into the model's and RSPC's patches; token dropping has a
    model that supports it, with one RSPC patch per token (`rspc.check_model`)."""
    rspc.check_model(config.rspc, model, config.model_name)
    sizes = {"model patch_size": model.patch_size}
    if config.rspc.enabled:
        sizes["rspc.patch_size"] = rspc.corruption_patch_size(config.rspc, model)
    for what, patch in sizes.items():
        if config.image_size % patch:
            raise ConfigError(
                f"image_size {config.image_size} is not divisible by the {what} {patch}; "
                f"use an image size that is a multiple of {patch}"
            )


def step_settings(
    config, spec: datasets.DatasetSpec, steps_per_epoch: int = 1
) -> train_step_lib.StepSettings:
    """Resolves the run's switches into the static numbers the step needs: RSPC's as
    `rspc.settings_from_config` resolves them, adversarial training's; `steps_per_epoch`
    turns the switches given in epochs into steps."""
    mix = config.mixup
    mixup = None
    if mix.mixup_alpha > 0 or mix.cutmix_alpha > 0:
        mixup = dict(
            mixup_alpha=mix.mixup_alpha,
            cutmix_alpha=mix.cutmix_alpha,
            switch_prob=mix.switch_prob,
            prob=mix.prob,
        )
    return train_step_lib.StepSettings(
        num_classes=spec.num_classes,
        rspc=rspc.settings_from_config(config, spec, steps_per_epoch),
        label_smoothing=config.label_smoothing,
        mixup=mixup,
        ema_decay=config.ema_decay,
        compute_dtype=compute_dtype(config),
        patch_aug=config.patch_aug,
        adversarial=adversarial_training.resolve(config, steps_per_epoch),
        pixel_mean=tuple(spec.mean),
        pixel_std=tuple(spec.std),
        grad_accum_steps=config.grad_accum_steps,
    )


def compute_dtype(config):
    """None for float32 (no casts), else the jnp dtype of the forward pass."""
    return None if config.compute_dtype == "float32" else jnp.dtype(config.compute_dtype)


def state_specs(state: train_step_lib.TrainState, sharding: str, num_devices: int):
    """The PartitionSpecs of the train state (arrays or ShapeDtypeStructs) under
    `config.sharding`: 'replicated' everywhere, or 'fsdp' shards of the classifier's params,
    optimizer state and EMA (ZeRO-3); the small corruption model, the BatchNorm statistics,
    the step and the key stay replicated."""
    specs = jax.tree.map(lambda _: P(), state)
    if sharding == "replicated":
        return specs
    shard = functools.partial(parallel.fsdp_specs, num_devices=num_devices)
    return specs.replace(
        params=shard(state.params),
        opt_state=shard(state.opt_state),
        ema_params=shard(state.ema_params),
    )


class Parts(NamedTuple):
    init: Callable  # rng -> TrainState, laid out as `config.sharding` says; keeps no program
    train_step: Callable  # (state, global batch) -> (state, metrics)
    # (state, tuple of config.steps_per_call global batches) -> (state, metrics stacked over
    # the steps); None when steps_per_call is 1.
    train_steps: Callable | None = None
    # The state's shapes, dtypes and shardings (jax.ShapeDtypeStruct): to compile the steps
    # for before the state exists (the loop's memory check), as the state itself would.
    state_shapes: Any = None


def abstract_batch(mesh, batch_size: int, config) -> dict:
    """The shapes of a global training batch on `mesh` (as the data pipeline makes it for
    `config`), to compile the step for before any batch exists."""
    sharding = parallel.batch_sharded(mesh)
    shapes = on_device.batch_shapes(batch_size, config.image_size, config.random_erase_prob)
    return {
        name: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        for name, (shape, dtype) in shapes.items()
    }


def _dropping_its_program(init: Callable) -> Callable:
    """`init` (jitted), which drops its compiled program and traces after each call: a run
    creates its state once, and on CPU the program (every parameter's initialiser) would
    otherwise stay in host memory beside the train step's for the whole run."""

    @functools.wraps(init)
    def run(rng):
        try:
            return init(rng)
        finally:
            init.clear_cache()

    return run


def build(config, model, spec, mesh, steps_per_epoch: int, total_steps: int) -> Parts:
    """Optimizers, state initialiser and the jitted sharded steps for `mesh`."""
    image_shape = (config.image_size, config.image_size, 3)
    corruption_model = rspc.corruption_model_for(config.rspc, model)
    opt = config.optimizer
    schedule = optim.schedule_for_run(
        opt, batch_size=config.batch_size, steps_per_epoch=steps_per_epoch, total_steps=total_steps
    )
    abstract_params = models.abstract_variables(model, config.image_size)["params"]
    tx = optim.classifier_optimizer(opt, schedule, abstract_params, model.no_weight_decay_names)
    corruption_tx = rspc.corruption_optimizer(
        config.rspc.optimizer,
        warmup_steps=round(config.rspc.corruption_warmup_epochs * steps_per_epoch),
        curriculum_steps=round(config.rspc.corruption_curriculum_epochs * steps_per_epoch),
    )
    create = functools.partial(
        train_step_lib.create_train_state,
        model=model,
        corruption_model=corruption_model,
        image_shape=image_shape,
        tx=tx,
        corruption_tx=corruption_tx,
        ema=config.ema_decay > 0,
        ema_batch_stats=config.ema_batch_stats,
    )
    shapes = jax.eval_shape(create, jax.random.PRNGKey(0))
    specs = state_specs(shapes, config.sharding, mesh.size)
    shardings = parallel.shardings(mesh, specs)
    # A fresh state is created in its layout, and a checkpoint restores into it.
    init = _dropping_its_program(jax.jit(create, out_shardings=shardings))
    make_step = functools.partial(
        train_step_lib.make_train_step,
        mesh,
        specs,
        model=model,
        corruption_model=corruption_model,
        tx=tx,
        corruption_tx=corruption_tx,
        schedule=schedule,
        settings=step_settings(config, spec, steps_per_epoch),
    )
    several = config.steps_per_call
    shapes = jax.tree.map(
        lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
        shapes,
        shardings,
    )
    return Parts(init, make_step(), make_step(steps=several) if several > 1 else None, shapes)
