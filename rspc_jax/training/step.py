"""Train state, initialisation and the data-parallel RSPC / plain train step.

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
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
import optax

from rspc_jax import rspc
from rspc_jax.evaluation import selection
from rspc_jax.models import ops
from rspc_jax.parallel import DATA_AXIS, sharded_axis
from rspc_jax.training import adversarial as adversarial_training
from rspc_jax.training import mixup, patch_aug


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
    rspc_enabled: bool
    rho: float
    lam: float
    ste_clip: Any  # float or None (identity STE)
    corruption_grad_scale: float
    noise_mean: Any  # noise = (u - mean) / std; (0,)/(1,) = normalised-space noise
    noise_std: Any
    clamp_lower: Any  # None = no clamp
    clamp_upper: Any
    random_selection: bool
    align_blocks: Any  # None = all blocks
    label_smoothing: float
    mixup: Any  # dict of mixup/cutmix settings, None = off
    ema_decay: float
    compute_dtype: Any = None  # None = float32; jnp.bfloat16 = bf16 forward, f32 params
    patch_aug: str = "off"  # RVT* patch-wise augmentation: 'off' | 'official' | 'intended'
    rspc_objective: str = "align"  # 'align' (paper) | 'ce' (CE on the occluded images; ablation)
    fill: str = "noise"  # occluded patches: 'noise' (eq. 1) | 'zero' | 'drop' (ablations)
    adversarial: Any = None  # adversarial_training.Settings; None = off
    pixel_mean: Any = None  # the dataset's normalisation (adversarial training's pixel space)
    pixel_std: Any = None
    grad_accum_steps: int = 1  # micro-batches per device batch, one optimizer update
    object_threshold: Any = None  # pixels above it hold the object, where a dataset says so
    # None: the official quantile rule; a temperature: C's masks by rspc.sampled_keep_mask.
    selection_temperature: Any = None


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


def _micro_batches(tree, count: int):
    """Splits the leading (example) axis of every leaf into `count` consecutive slices."""
    return jax.tree.map(lambda x: x.reshape((count, x.shape[0] // count) + x.shape[1:]), tree)


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
    device = jax.lax.axis_index(DATA_AXIS)
    images, labels = batch["image"], batch["label"]
    local_batch = images.shape[0]
    noise_rng, dropout_rng, mix_rng, select_rng = step_keys(state)
    # Mixup/CutMix pairs are drawn over the device's whole batch, before it is split.
    images, targets = _targets(settings, jax.random.fold_in(mix_rng, device), images, labels)
    dropout_rng = jax.random.fold_in(dropout_rng, device)
    vary = functools.partial(jax.lax.pcast, axis_name=DATA_AXIS, to="varying")
    # Each device differentiates its share of the *global* mean loss and the gradients
    # are summed, so the gradient reaching the STE clip is that of the global-batch loss
    # and the step does not depend on how many devices (or micro-batches) share the batch.
    accum = settings.grad_accum_steps
    share = 1.0 / (jax.lax.psum(1, DATA_AXIS) * accum)
    # Folded from the step key rather than split off it, so that adding this stream left
    # the other keys (and every earlier run) unchanged.
    aug_noise_rng, aug_rng = jax.random.split(
        jax.random.fold_in(jax.random.fold_in(state.rng, state.step), 1)
    )
    aug_rng = jax.random.fold_in(aug_rng, device)
    # Noise, random masks and adversarial starts are keyed by the example's global index,
    # so they do not depend on how the batch is split over devices and micro-batches.
    example_ids = device * local_batch + jnp.arange(local_batch)
    # Whole, device-varying parameters, gathered once for all micro-batches.
    whole_params = _gather(state.params, param_specs)

    def grads_of(batch_stats, micro, micro_index):
        """(gradients, new BatchNorm statistics, metrics) of one micro-batch."""
        images, targets, example_ids = micro["image"], micro["target"], micro["id"]
        micro_batch = images.shape[0]
        rngs = {"dropout": dropout_rng}
        aug_device_rng = aug_rng
        if accum > 1:
            rngs = {"dropout": jax.random.fold_in(dropout_rng, micro_index)}
            aug_device_rng = jax.random.fold_in(aug_rng, micro_index)
        if settings.rspc_enabled:

            def noise_of(rng):
                if settings.fill != "noise":  # zeros; 'drop' never shows the filled image
                    return jnp.zeros_like(images)
                uniform = rspc.uniform_noise(rng, example_ids, images.shape[1:])
                return (uniform - jnp.asarray(settings.noise_mean)) / jnp.asarray(
                    settings.noise_std
                )

            num_patches = (images.shape[1] // corruption_model.patch_size) * (
                images.shape[2] // corruption_model.patch_size
            )
            random_scores, sampling = None, None
            if settings.random_selection:
                random_scores = rspc.uniform_noise(select_rng, example_ids, (num_patches,))
            elif settings.selection_temperature is not None:
                gumbel = rspc.gumbel_draws(
                    jax.random.fold_in(select_rng, 1), example_ids, num_patches
                )
                sampling = (gumbel, settings.selection_temperature)
            probe = vary(jnp.zeros((micro_batch, num_patches), jnp.float32))
            rspc_loss = functools.partial(
                rspc.rspc_loss,
                model=model,
                corruption_model=corruption_model,
                rho=settings.rho,
                lam=settings.lam,
                ste_clip=settings.ste_clip,
                grad_scale=settings.corruption_grad_scale,
                lower=settings.clamp_lower,
                upper=settings.clamp_upper,
                align_blocks=settings.align_blocks,
                random_scores=random_scores,
                sampling=sampling,
                compute_dtype=settings.compute_dtype,
                objective=settings.rspc_objective,
                drop_tokens=settings.fill == "drop",
            )

            def loss_of(params, corruption_params, batch_stats, images, noise_rng, rngs, probe):
                return rspc_loss(
                    params,
                    corruption_params,
                    batch_stats,
                    images,
                    targets,
                    noise_of(noise_rng),
                    rngs=rngs,
                    mask_probe=probe,
                )

            args = (whole_params, vary(state.corruption_params), probe)
        elif settings.adversarial is not None:

            def loss_of(params, corruption_params, batch_stats, images, noise_rng, rngs, probe):
                return adversarial_training.adversarial_loss(
                    params,
                    batch_stats,
                    images,
                    targets,
                    noise_rng,
                    example_ids,
                    state.step,
                    model=model,
                    settings=settings.adversarial,
                    mean=settings.pixel_mean,
                    std=settings.pixel_std,
                    rngs=rngs,
                    compute_dtype=settings.compute_dtype,
                )

            args = (whole_params, {}, None)
        else:

            def loss_of(params, corruption_params, batch_stats, images, noise_rng, rngs, probe):
                return rspc.plain_loss(
                    params,
                    batch_stats,
                    images,
                    targets,
                    model=model,
                    rngs=rngs,
                    compute_dtype=settings.compute_dtype,
                )

            args = (whole_params, {}, None)

        def objective(params, corruption_params, probe):
            stats, aug_loss = batch_stats, 0.0
            if settings.patch_aug != "off":
                # RSPC_RVT first runs the whole step on the patch-augmented batch (own mask
                # and noise), then on the clean one; its gradients are zeroed before the
                # update ('official': only the BatchNorm statistics keep it) or, as
                # intended, added.
                aug_images = patch_aug.patch_augment(
                    aug_device_rng,
                    images,
                    model.patch_size,
                    settings.clamp_lower,
                    settings.clamp_upper,
                )
                aug_args = (params, corruption_params)
                if settings.patch_aug == "official":
                    aug_args = jax.lax.stop_gradient(aug_args)
                aug_total, aug_aux = loss_of(
                    *aug_args,
                    stats,
                    aug_images,
                    aug_noise_rng,
                    {"dropout": jax.random.fold_in(aug_device_rng, 1)},
                    None,
                )
                stats = aug_aux["batch_stats"]
                if settings.patch_aug == "intended":
                    aug_loss = aug_total
            loss, aux = loss_of(params, corruption_params, stats, images, noise_rng, rngs, probe)
            return (loss + aug_loss) * share, (loss, aux)

        argnums = (0, 1, 2) if settings.rspc_enabled else 0
        (_, (loss, aux)), all_grads = jax.value_and_grad(objective, argnums=argnums, has_aux=True)(
            *args
        )
        grads = all_grads if settings.rspc_enabled else (all_grads, {}, None)
        metrics = dict(
            loss=loss,
            ce=aux["ce"],
            train_accuracy=jnp.mean(jnp.argmax(aux["logits"], -1) == jnp.argmax(targets, -1)),
        )
        metrics.update({k: aux[k] for k in ("eps", "robust_kl") if k in aux})
        chosen = {}
        if settings.rspc_enabled:
            # The objective C ascends besides CE: L_align, or CE on the occluded images.
            metrics.update({k: aux[k] for k in ("align", "occluded_ce") if k in aux})
            probe_grad = grads[2]
            saturated = jnp.abs(probe_grad * settings.corruption_grad_scale) >= (
                settings.ste_clip or jnp.inf
            )
            metrics.update(
                occluded_fraction=1.0 - jnp.mean(aux["keep"]),
                ste_saturated_fraction=jnp.mean(saturated),
            )
            # C's masks, for the statistics of its selection over the global batch; and the
            # weight of its objective in the classifier's loss.
            chosen["occluded"] = (1 - aux["keep"]).astype(jnp.int8)
            if settings.object_threshold is not None:
                pixels = images * jnp.asarray(settings.pixel_std) + jnp.asarray(settings.pixel_mean)
                chosen["on_object"] = selection.object_patches(
                    pixels, corruption_model.patch_size, settings.object_threshold
                )
            if "align" in aux:
                metrics["weighted_align_to_ce"] = settings.lam * aux["align"] / aux["ce"]
        return grads[:2], aux["batch_stats"], metrics, chosen

    device_batch = dict(image=images, target=targets, id=example_ids)
    if accum == 1:
        (grads, corruption_grads), batch_stats, metrics, chosen = grads_of(
            state.batch_stats, device_batch, 0
        )
    else:
        # One compiled loop over the micro-batches: gradients are summed, BatchNorm
        # statistics are those of each micro-batch (the running averages see each in turn),
        # and every metric is the mean over micro-batches (each of equal size).
        def accumulate(carry, micro):
            grad_sums, batch_stats = carry
            grads, batch_stats, metrics, chosen = grads_of(
                batch_stats, micro["batch"], micro["index"]
            )
            return (jax.tree.map(jnp.add, grad_sums, grads), batch_stats), (metrics, chosen)

        zeros = jax.tree.map(jnp.zeros_like, (whole_params, vary(state.corruption_params)))
        micro_batches = dict(batch=_micro_batches(device_batch, accum), index=jnp.arange(accum))
        ((grads, corruption_grads), batch_stats), (metrics, chosen) = jax.lax.scan(
            accumulate, (zeros, vary(state.batch_stats)), micro_batches
        )
        metrics = jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics)
        chosen = jax.tree.map(lambda c: c.reshape((local_batch,) + c.shape[2:]), chosen)

    grads = _sum_over_devices(grads, param_specs)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics.update(lr=schedule(state.step), grad_norm=_global_norm(grads, param_specs))

    corruption_params, corruption_opt_state = state.corruption_params, state.corruption_opt_state
    if settings.rspc_enabled:
        corruption_grads = jax.lax.psum(corruption_grads, DATA_AXIS)
        corruption_updates, corruption_opt_state = corruption_tx.update(
            corruption_grads, corruption_opt_state, corruption_params
        )
        corruption_params = optax.apply_updates(corruption_params, corruption_updates)
        metrics.update(corruption_grad_norm=optax.tree.norm(corruption_grads))

    # Per-device BatchNorm statistics (official DDP) are averaged so the state stays replicated.
    batch_stats = jax.lax.pmean(batch_stats, DATA_AXIS)
    ema_params, ema_batch_stats = state.ema_params, state.ema_batch_stats
    if settings.ema_decay > 0:
        # timm's ModelEmaV2: every parameter and (with ema_batch_stats) every buffer.
        def average(ema, new):
            return jax.tree.map(
                lambda e, p: settings.ema_decay * e + (1.0 - settings.ema_decay) * p, ema, new
            )

        ema_params = average(ema_params, params)
        if ema_batch_stats:
            ema_batch_stats = average(ema_batch_stats, batch_stats)
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
    # Flags a step whose loss, gradients or results are not finite; the loop checks the flags
    # of every step before it saves or evaluates anything and stops at the first one, so no
    # checkpoint holds what such a step produced. (The loss alone is not enough: step k's loss
    # comes from step k-1's parameters, and an overflowing update shows only one step later.)
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
    if chosen:  # over the global batch, however it is split
        chosen = jax.lax.all_gather(chosen, DATA_AXIS, tiled=True)
        stats = selection.statistics(chosen["occluded"], chosen.get("on_object"))
        metrics.update({f"selection_{name}": value for name, value in stats.items()})
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
    than once per step (docs/speed.md)."""

    def train_steps(state, batches):
        return jax.lax.scan(train_step, state, jax.tree.map(lambda *b: jnp.stack(b), *batches))

    return train_steps
