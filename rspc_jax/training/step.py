"""Train state, initialisation and the data-parallel train step.

The step is a shell around one objective (training/objectives.py, chosen by name from the
settings): it splits the device's batch into micro-batches and sums their gradients, gathers
and reduces over the devices, applies the classifier's and (when the objective trains one)
the corruption model's optimizer, the EMA, and flags non-finite steps.

Steps are written per device (`jax.shard_map`) with explicit collectives. Replicated
parameters are `pcast` to device-varying before differentiation: under shard_map's
default `check_vma=True` the gradient of an invariant input would otherwise come out
already summed over devices implicitly; we sum it explicitly instead (`psum` of each
device's share of the global-mean loss). Under FSDP (`config.sharding='fsdp'`) the big
classifier arrays (params, Adam moments, EMA) are held as shards: the step all-gathers the
parameters whole for the forward/backward, reduce-scatters their gradients onto the shards
and updates the shards.
"""

from collections.abc import Callable
import dataclasses
import functools
from typing import Any, NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
import optax

from rspc_jax.data import on_device
from rspc_jax.evaluation import selection
from rspc_jax.models import ops
from rspc_jax.parallel import DATA_AXIS, sharded_axis
from rspc_jax.training import mixup, objectives


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    batch_stats: Any
    opt_state: Any
    corruption_params: Any  # corruption model C ({} when RSPC is off)
    corruption_opt_state: Any
    ema_params: Any  # {} when EMA is off
    rng: jax.Array  # base key; the step key is fold_in(rng, step)
    # EMA of the BatchNorm statistics ({} when EMA is off, config.ema_batch_stats is False or
    # the model has no BatchNorm). Last, so that older checkpoints keep their field order.
    ema_batch_stats: Any = flax.struct.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """Static settings of the step, resolved from the config once."""

    num_classes: int
    rspc: Any  # rspc.Settings: every RSPC switch, resolved by rspc.settings_from_config
    label_smoothing: float
    mixup: Any  # dict of mixup/cutmix settings, None = off
    ema_decay: float
    compute_dtype: Any = None  # None = float32; jnp.bfloat16 = bf16 forward, f32 params
    patch_aug: str = "off"  # RVT* patch-wise augmentation: 'off' | 'official' | 'intended'
    adversarial: Any = None  # adversarial_training.Settings; None = off
    pixel_mean: Any = None  # the dataset's normalisation (adversarial training's pixel space)
    pixel_std: Any = None
    grad_accum_steps: int = 1  # micro-batches per device batch, one optimizer update


def create_train_state(
    rng,
    model: nn.Module,
    corruption_model,
    image_shape,
    tx,
    corruption_tx,
    ema: bool,
    ema_batch_stats: bool = True,
) -> TrainState:
    """Initialises every part of the state (jit it with replicated out_shardings)."""
    model_rng, corruption_rng, state_rng = jax.random.split(rng, 3)
    dummy = jnp.zeros((1,) + tuple(image_shape), jnp.float32)
    variables = model.init(model_rng, dummy, train=False)
    params, batch_stats = variables["params"], variables.get("batch_stats", {})
    corruption_params = (
        corruption_model.init(corruption_rng, dummy)["params"]
        if corruption_model is not None
        else {}
    )
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        batch_stats=batch_stats,
        opt_state=tx.init(params),
        corruption_params=corruption_params,
        corruption_opt_state=corruption_tx.init(corruption_params)
        if corruption_model is not None
        else {},
        ema_params=jax.tree.map(jnp.copy, params) if ema else {},
        rng=state_rng,
        ema_batch_stats=jax.tree.map(jnp.copy, batch_stats) if ema and ema_batch_stats else {},
    )


def _targets(settings: StepSettings, rng, images, labels):
    if settings.mixup is None:
        return images, mixup.one_hot_smoothed(
            labels, settings.num_classes, settings.label_smoothing
        )
    return mixup.mixup_cutmix(
        rng,
        images,
        labels,
        num_classes=settings.num_classes,
        smoothing=settings.label_smoothing,
        **settings.mixup,
    )


def step_keys(state: TrainState):
    """(noise, dropout, mixup, selection) keys of this step; the first is device-independent."""
    return jax.random.split(jax.random.fold_in(state.rng, state.step), 4)


class DeviceKeys(NamedTuple):
    """This step's random streams on one device. Noise, random masks and adversarial starts
    are keyed by the example's global index, so they do not depend on how the batch is
    split over devices and micro-batches; dropout and patch augmentation are folded by device."""

    noise: jax.Array
    dropout: jax.Array
    select: jax.Array
    aug_noise: jax.Array  # the occlusion noise of patch augmentation's pass
    aug: jax.Array  # patch augmentation's draws and its pass's dropout


def _device_keys(state: TrainState, device) -> tuple[DeviceKeys, jax.Array]:
    """(this device's keys, its mixup key)."""
    noise_rng, dropout_rng, mix_rng, select_rng = step_keys(state)
    # Folded from the step key rather than split off it, so that adding this stream left
    # the other keys (and every earlier run) unchanged.
    aug_noise_rng, aug_rng = jax.random.split(
        jax.random.fold_in(jax.random.fold_in(state.rng, state.step), 1)
    )
    keys = DeviceKeys(
        noise=noise_rng,
        dropout=jax.random.fold_in(dropout_rng, device),
        select=select_rng,
        aug_noise=aug_noise_rng,
        aug=jax.random.fold_in(aug_rng, device),
    )
    return keys, jax.random.fold_in(mix_rng, device)


def _micro_batch_keys(keys: DeviceKeys, index, count: int):
    """(the model's rngs, patch augmentation's key) of micro-batch `index` of `count`."""
    if count == 1:
        return {"dropout": keys.dropout}, keys.aug
    return {"dropout": jax.random.fold_in(keys.dropout, index)}, jax.random.fold_in(keys.aug, index)


def _micro_batches(tree, count: int):
    """Splits the leading (example) axis of every leaf into `count` consecutive slices."""
    return jax.tree.map(lambda x: x.reshape((count, x.shape[0] // count) + x.shape[1:]), tree)


@dataclasses.dataclass(frozen=True)
class _Frame:
    """What every micro-batch of one device's step shares."""

    objective: objectives.Objective
    model: Any
    corruption_model: Any
    settings: StepSettings
    step: jax.Array
    keys: DeviceKeys
    share: Any  # this device's (and micro-batch's) share of the global-mean loss
    params: Any  # whole and device-varying
    corruption_params: Any


def _differentiated(loss, ctx, batch_stats, images, noise_rng, rngs, share):
    """(params, corruption_params, mask_probe) -> (share * loss, (loss, aux)); the loss a
    wrapper adds (aux['added_loss']) counts in the gradient only."""

    def scaled(params, corruption_params, mask_probe):
        value, aux = loss(
            ctx, params, corruption_params, mask_probe, batch_stats, images, noise_rng, rngs
        )
        return (value + aux.get("added_loss", 0.0)) * share, (value, aux)

    return scaled


def _value_and_grads(objective: objectives.Objective, scaled, ctx, frame: _Frame, images):
    """((loss, aux), (classifier's, C's and the mask probe's gradients)) of `scaled`, by
    the objective's differentiable inputs."""
    if objective.extra_inputs is None:
        (_, (value, aux)), grads = jax.value_and_grad(scaled, has_aux=True)(frame.params, {}, None)
        return (value, aux), (grads, {}, None)
    extra = _varying(objective.extra_inputs(ctx, frame.corruption_params, images))
    (_, (value, aux)), grads = jax.value_and_grad(scaled, argnums=(0, 1, 2), has_aux=True)(
        frame.params, *extra
    )
    return (value, aux), grads


def _micro_batch_grads(frame: _Frame, batch_stats, micro, index):
    """(gradients of the classifier and of C, new BatchNorm statistics, metrics, chosen
    masks) of one micro-batch."""
    images, targets, settings = micro["image"], micro["target"], frame.settings
    rngs, aug_key = _micro_batch_keys(frame.keys, index, settings.grad_accum_steps)
    ctx = objectives.Context(
        model=frame.model,
        corruption_model=frame.corruption_model,
        settings=settings,
        step=frame.step,
        select_rng=frame.keys.select,
        targets=targets,
        example_ids=micro["id"],
    )
    loss = frame.objective.loss
    if settings.patch_aug != "off":
        loss = objectives.with_patch_aug(loss, settings.patch_aug, aug_key, frame.keys.aug_noise)
    scaled = _differentiated(loss, ctx, batch_stats, images, frame.keys.noise, rngs, frame.share)
    (value, aux), grads = _value_and_grads(frame.objective, scaled, ctx, frame, images)
    metrics, chosen = frame.objective.metrics(ctx, images, aux, grads[2])
    accuracy = jnp.mean(jnp.argmax(aux["logits"], -1) == jnp.argmax(targets, -1))
    metrics.update(loss=value, ce=aux["ce"], train_accuracy=accuracy)
    return grads[:2], aux["batch_stats"], metrics, chosen


def _accumulated_grads(frame: _Frame, batch_stats, device_batch):
    """`_micro_batch_grads` over the device's batch in config.grad_accum_steps micro-batches:
    one compiled loop in which gradients are summed, BatchNorm statistics are those of each
    micro-batch (the running averages see each in turn), and every metric is the mean over
    micro-batches (each of equal size)."""
    count = frame.settings.grad_accum_steps
    if count == 1:
        return _micro_batch_grads(frame, batch_stats, device_batch, 0)

    def accumulate(carry, micro):
        grad_sums, batch_stats = carry
        grads, batch_stats, metrics, chosen = _micro_batch_grads(
            frame, batch_stats, micro["batch"], micro["index"]
        )
        return (jax.tree.map(jnp.add, grad_sums, grads), batch_stats), (metrics, chosen)

    zeros = jax.tree.map(jnp.zeros_like, (frame.params, _varying(frame.corruption_params)))
    micro_batches = dict(batch=_micro_batches(device_batch, count), index=jnp.arange(count))
    (grads, batch_stats), (metrics, chosen) = jax.lax.scan(
        accumulate, (zeros, _varying(batch_stats)), micro_batches
    )
    metrics = jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics)
    local_batch = device_batch["image"].shape[0]
    chosen = jax.tree.map(lambda c: c.reshape((local_batch,) + c.shape[2:]), chosen)
    return grads, batch_stats, metrics, chosen


def _varying(tree):
    return jax.lax.pcast(tree, DATA_AXIS, to="varying")


def _classifier_update(tx, state: TrainState, grads, param_specs):
    """(params, optimizer state, gradient norm) after the devices' gradients are summed."""
    grads = _sum_over_devices(grads, param_specs)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    return optax.apply_updates(state.params, updates), opt_state, _global_norm(grads, param_specs)


def _corruption_update(corruption_tx, state: TrainState, grads):
    """(C's params, its optimizer state, gradient norm) after the devices' gradients are summed."""
    grads = jax.lax.psum(grads, DATA_AXIS)
    updates, opt_state = corruption_tx.update(
        grads, state.corruption_opt_state, state.corruption_params
    )
    return optax.apply_updates(state.corruption_params, updates), opt_state, optax.tree.norm(grads)


def _ema_update(decay: float, state: TrainState, params, batch_stats):
    """timm's ModelEmaV2: every parameter and (with ema_batch_stats) every buffer."""
    if decay <= 0:
        return state.ema_params, state.ema_batch_stats

    def average(ema, new):
        return jax.tree.map(lambda e, p: decay * e + (1.0 - decay) * p, ema, new)

    ema_batch_stats = state.ema_batch_stats
    if ema_batch_stats:
        ema_batch_stats = average(ema_batch_stats, batch_stats)
    return average(state.ema_params, params), ema_batch_stats


def _updated_state(state, grads, batch_stats, *, tx, corruption_tx, ema_decay, param_specs):
    """(the state after this step's updates, their metrics); `corruption_tx` None: the
    objective trains no corruption model."""
    params, opt_state, grad_norm = _classifier_update(tx, state, grads[0], param_specs)
    metrics = dict(grad_norm=grad_norm)
    corruption_params, corruption_opt_state = state.corruption_params, state.corruption_opt_state
    if corruption_tx is not None:
        corruption_params, corruption_opt_state, metrics["corruption_grad_norm"] = (
            _corruption_update(corruption_tx, state, grads[1])
        )
    # Per-device BatchNorm statistics (official DDP) are averaged so the state stays replicated.
    batch_stats = jax.lax.pmean(batch_stats, DATA_AXIS)
    ema_params, ema_batch_stats = _ema_update(ema_decay, state, params, batch_stats)
    new_state = state.replace(
        step=state.step + 1,
        params=params,
        opt_state=opt_state,
        batch_stats=batch_stats,
        corruption_params=corruption_params,
        corruption_opt_state=corruption_opt_state,
        ema_params=ema_params,
        ema_batch_stats=ema_batch_stats,
    )
    return new_state, metrics


def _finite(new_state: TrainState, metrics, param_specs) -> jax.Array:
    """False when the step's loss, gradients or results are not finite, on every device.

    The loop checks the flags of every step before it saves or evaluates anything and stops
    at the first such step, so no checkpoint holds what it produced. (The loss alone is not
    enough: step k's loss comes from step k-1's parameters, and an overflowing update shows
    only one step later.)"""
    replicated_params, param_shards = _partition(new_state.params, param_specs)
    finite = _all_finite(
        jax.lax.psum(metrics["loss"], DATA_AXIS),
        metrics["grad_norm"],
        metrics.get("corruption_grad_norm", 0.0),
        replicated_params,
        new_state.corruption_params,
        new_state.batch_stats,
    )
    if param_shards:  # each device checks its own shards; the flag must be global
        finite &= jax.lax.pmin(_all_finite(param_shards), DATA_AXIS)
    return finite


def _selection_statistics(chosen) -> dict:
    """Statistics of the chosen masks over the global batch, however it is split."""
    chosen = jax.lax.all_gather(chosen, DATA_AXIS, tiled=True)
    stats = selection.statistics(chosen["occluded"], chosen.get("on_object"))
    return {f"selection_{name}": value for name, value in stats.items()}


def _device_batch(state: TrainState, batch, settings: StepSettings):
    """(this device's batch: images (normalised and erased here where the host sent uint8,
    `on_device.prepared`), soft targets and global example indices; its keys)."""
    device = jax.lax.axis_index(DATA_AXIS)
    keys, mix_rng = _device_keys(state, device)
    images = on_device.prepared(batch, settings.pixel_mean, settings.pixel_std)
    # Mixup/CutMix pairs are drawn over the device's whole batch, before it is split.
    images, targets = _targets(settings, mix_rng, images, batch["label"])
    local_batch = images.shape[0]
    example_ids = device * local_batch + jnp.arange(local_batch)
    return dict(image=images, target=targets, id=example_ids), keys


def _loss_share(settings: StepSettings):
    """The weight of one device's micro-batch mean loss in the global-mean loss.

    Each device differentiates its share of the *global* mean loss and the gradients are
    summed, so the gradient reaching the STE clip is that of the global-batch loss and the
    step does not depend on how many devices (or micro-batches) share the batch."""
    return 1.0 / (jax.lax.psum(1, DATA_AXIS) * settings.grad_accum_steps)


def _per_device_train_step(
    state: TrainState,
    batch,
    *,
    model,
    corruption_model,
    tx,
    corruption_tx,
    schedule: Callable,
    settings: StepSettings,
    param_specs: Any,
):
    objective = objectives.get(objectives.name_of(settings))
    device_batch, keys = _device_batch(state, batch, settings)
    frame = _Frame(
        objective=objective,
        model=model,
        corruption_model=corruption_model,
        settings=settings,
        step=state.step,
        keys=keys,
        share=_loss_share(settings),
        params=_gather(state.params, param_specs),  # gathered once for all micro-batches
        corruption_params=state.corruption_params,
    )
    grads, batch_stats, metrics, chosen = _accumulated_grads(frame, state.batch_stats, device_batch)
    new_state, update_metrics = _updated_state(
        state,
        grads,
        batch_stats,
        tx=tx,
        # C's optimizer runs where the objective differentiates a C that the run has.
        corruption_tx=None
        if objective.extra_inputs is None or corruption_model is None
        else corruption_tx,
        ema_decay=settings.ema_decay,
        param_specs=param_specs,
    )
    metrics.update(update_metrics, lr=schedule(state.step))
    finite = _finite(new_state, metrics, param_specs)
    if chosen:
        metrics.update(_selection_statistics(chosen))
    metrics = jax.lax.pmean(metrics, DATA_AXIS)
    metrics["nonfinite"] = 1.0 - finite.astype(jnp.float32)
    return new_state, metrics


def _all_finite(*trees) -> jax.Array:
    """True when every number in `trees` is finite (one boolean reduction per array)."""
    leaves = jax.tree.leaves(trees)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves]))


def _gather(params, specs):
    """Whole device-varying parameters (see the module docstring): FSDP shards are
    all-gathered, replicated arrays pcast."""

    def whole(x, spec):
        axis = sharded_axis(spec)
        if axis is None:
            return jax.lax.pcast(x, DATA_AXIS, to="varying")
        return jax.lax.all_gather(x, DATA_AXIS, axis=axis, tiled=True)

    return jax.tree.map(whole, params, specs)


def _sum_over_devices(grads, specs):
    """The devices' gradients summed: whole (psum) for replicated parameters, only this
    device's shard (psum_scatter) for FSDP-sharded ones."""
    replicated, _ = _partition(grads, specs)
    summed = iter(jax.lax.psum(replicated, DATA_AXIS))  # one psum, as without FSDP

    def total(g, spec):
        axis = sharded_axis(spec)
        if axis is None:
            return next(summed)  # tree.map visits the leaves in _partition's order
        return jax.lax.psum_scatter(g, DATA_AXIS, scatter_dimension=axis, tiled=True)

    return jax.tree.map(total, grads, specs)


def _partition(tree, specs) -> tuple[list, list]:
    """(replicated arrays, FSDP shards) of a params-like tree."""
    leaves, treedef = jax.tree.flatten(tree)
    axes = [sharded_axis(spec) for spec in treedef.flatten_up_to(specs)]
    return (
        [x for x, axis in zip(leaves, axes) if axis is None],
        [x for x, axis in zip(leaves, axes) if axis is not None],
    )


def _global_norm(grads, specs) -> jax.Array:
    """The L2 norm of the whole gradient, of which each device holds the FSDP shards'
    parts: their squares are summed over devices, the replicated arrays' counted once."""
    replicated, shards = _partition(grads, specs)
    if not shards:
        return optax.tree.norm(grads)
    squares = optax.tree.norm(replicated, squared=True)
    return jnp.sqrt(squares + jax.lax.psum(optax.tree.norm(shards, squared=True), DATA_AXIS))


def make_train_step(mesh: Mesh, state_specs: TrainState, steps: int = 1, **kwargs):
    """jit(shard_map(step)): the state laid out by `state_specs` (PartitionSpecs: replicated,
    or FSDP shards), the batch split over the data axis; the state is donated. With
    `steps` > 1 it takes a tuple of that many batches and runs the steps in sequence in one
    call, their metrics stacked."""
    step = functools.partial(_per_device_train_step, param_specs=state_specs.params, **kwargs)
    if steps > 1:
        step = _in_sequence(step)
    sharded = jax.shard_map(
        step, mesh=mesh, in_specs=(state_specs, P(DATA_AXIS)), out_specs=(state_specs, P())
    )
    return jax.jit(sharded, donate_argnums=0, compiler_options=ops.compiler_options())


def _in_sequence(train_step: Callable) -> Callable:
    """(state, tuple of batches) -> (state, metrics stacked over the steps): one lax.scan,
    so one dispatch for all, and XLA:CPU maps the step's temporaries once per call rather
    than once per step."""

    def train_steps(state, batches):
        return jax.lax.scan(train_step, state, jax.tree.map(lambda *b: jnp.stack(b), *batches))

    return train_steps
