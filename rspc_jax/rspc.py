"""RSPC core (Guo, Stutz, Schiele, CVPR 2023, Sec. 3 / Algorithm 1), as the official code runs it.

One file, each piece a pure function that can be tested alone:

1. `PatchCorruptionModel` C: conv (kernel = stride = patch, 3->1, no bias) -> exact GELU
   -> Dense(N->N, no bias) -> one score per patch.
2. `binarize` (a `jax.custom_vjp` straight-through estimator): per image, keep the
   patches whose score is strictly above the linear-interpolation rho-quantile, i.e.
   occlude the floor(rho*(N-1))+1 lowest scores (20 of 196 at rho=0.1). Backward:
   clip(S * g, -1, 1) (official hardtanh; S emulates the AMP loss scale, see below).
   Beside it (`rspc.corruption_model='content'`, not in the paper): `ContentCorruptionModel`,
   a C that scores each patch from its own pixels only, selected by `sampled_keep_mask`
   (exactly that many patches per image, Gumbel top-k; docs/method.md, "A per-image C").
   Also beside it (`rspc.learned_fraction`, `learned_fraction_ramp_epochs`,
   `learned_batch_fraction`, not in the paper): `mixed_keep_mask`, C's mask with part of it
   redrawn at random (docs/method.md, "Mixed masks"). And (`rspc.selection='attended'`,
   `'random_attended'`, not in the paper): no C at all, the patches the classifier attends to
   most in an extra clean forward (`clean_attention`; docs/method.md, "Occluding what the
   classifier attends to").
3. `occlude` (eq. 1): x_hat = clamp(m * x + (1 - m) * delta, lower, upper).
4. `alignment_loss` (eq. 2 with the official reduction): mean over all backbone
   blocks of the element-wise mean squared difference between the corrupted and the
   clean half of one concatenated forward pass; the clean side is not detached.
5. `rspc_loss`: one forward over [x_hat; x], CE on the clean half only, CE + lam * L_align.
6. `Settings` (`settings_from_config`), what the step holds of config.rspc, and `SELECTIONS`,
   one function per value of `rspc.selection`, with the checks that need the data or model.

Deviations of the official code from the paper's wording (all defaults follow the code;
docs/method.md, "Paper vs official code"): the noise is U[0,1) in *normalised* space and
clamped to the ImageNet-normalised [0,1] range; the loss is a mean, not a sum of
squares; C ascends the full loss (CE reaches C only through BatchNorm statistics); the
official C gradient is that of the GradScaler-scaled loss (S = 2**16 at the start of
training), which the `grad_scale` of the STE emulates.
"""

from collections.abc import Callable, Sequence
import dataclasses
import functools
import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from rspc_jax import ConfigError
from rspc_jax.models import layers

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def num_occluded(num_patches: int, rho: float) -> int:
    """Patches occluded per image by the official rule (distinct scores): floor(rho*(N-1)) + 1."""
    return math.floor(rho * (num_patches - 1)) + 1


def check_ratio(rho: float) -> None:
    if not 0.0 < rho < 1.0:
        raise ValueError(f"occlusion ratio rho must lie in (0, 1), got {rho}; the paper uses 0.1")


def _check_patch_grid(images, patch_size: int) -> int:
    """Refuses images that patches of `patch_size` do not tile; returns their channels."""
    height, width, channels = images.shape[1:]
    if height % patch_size or width % patch_size:
        raise ValueError(
            f"image size {height}x{width} is not divisible by the RSPC patch size {patch_size}"
        )
    return channels


class PatchCorruptionModel(nn.Module):
    """The lightweight corruption model C. Its Dense layer is N x N, N read from the input."""

    patch_size: int = 16

    @nn.compact
    def __call__(self, images):
        channels = _check_patch_grid(images, self.patch_size)
        fan_in = channels * self.patch_size**2
        x = layers.Conv(
            1,
            self.patch_size,
            strides=self.patch_size,
            use_bias=False,
            kernel_init=layers.torch_default_uniform(fan_in),
            name="patch_embed",
        )(images)
        x = layers.gelu(x).reshape(images.shape[0], -1)  # row-major patch order
        num_patches = x.shape[1]
        return layers.dense(
            num_patches,
            use_bias=False,
            kernel_init=layers.torch_default_uniform(num_patches),
            name="fc",
        )(x)


class ContentCorruptionModel(nn.Module):
    """A C that scores each patch from that patch's pixels alone: conv (kernel = stride =
    patch, 3 -> `hidden`, no bias) -> exact GELU -> a shared linear map to one score.

    The official C's N x N Dense layer lets a score depend on where a patch is, and on the
    digits it learns a per-position bias that gives every image the same mask
    (docs/study/findings.md). This C has no position information: two patches with the same
    pixels get the same score wherever they are, so only image content can rank patches.
    """

    patch_size: int = 16
    hidden: int = 16

    @nn.compact
    def __call__(self, images):
        channels = _check_patch_grid(images, self.patch_size)
        x = layers.Conv(
            self.hidden,
            self.patch_size,
            strides=self.patch_size,
            use_bias=False,
            kernel_init=layers.torch_default_uniform(channels * self.patch_size**2),
            name="patch_embed",
        )(images)
        x = layers.dense(
            1,
            use_bias=False,
            kernel_init=layers.torch_default_uniform(self.hidden),
            name="score",
        )(layers.gelu(x))
        return x.reshape(images.shape[0], -1)  # row-major patch order


CORRUPTION_MODELS = {"official": PatchCorruptionModel, "content": ContentCorruptionModel}


def make_corruption_model(rspc_config, patch_size: int) -> nn.Module:
    """C as `rspc.corruption_model` names it, for `patch_size` patches."""
    return CORRUPTION_MODELS[rspc_config.corruption_model](patch_size)


def keep_mask(scores: jax.Array, rho: float) -> jax.Array:
    """1 = keep, 0 = occlude: scores strictly above the per-image linear rho-quantile."""
    threshold = jnp.quantile(
        scores.astype(jnp.float32), rho, axis=1, method="linear", keepdims=True
    )
    return (scores > threshold).astype(scores.dtype)


# At temperature 0 ties between standardised scores are broken by Gumbel noise of this scale:
# it reorders only scores within a few millionths of a standard deviation of each other.
TIE_BREAK = 1e-6


def sampled_keep_mask(
    scores: jax.Array, rho: float, gumbel: jax.Array, temperature: float
) -> jax.Array:
    """1 = keep: per image exactly `num_occluded(N, rho)` patches occluded, sampled without
    replacement with probabilities softmax(-z / temperature), z the image's scores
    standardised over its patches (Gumbel top-k: the lowest z - temperature * gumbel).

    `gumbel` (B, N) holds standard Gumbel draws. At temperature 0 the lowest scores are
    occluded, exact ties broken by the draws (not by position). Standardising makes the
    temperature mean the same whatever the scale C's scores grow to.
    """
    lowest = lowest_patches(scores, num_occluded(scores.shape[1], rho), gumbel, temperature)
    return (~lowest).astype(jnp.float32)


def lowest_patches(scores, count: int, gumbel, temperature: float) -> jax.Array:
    """(B, N) True on the `count` lowest z - max(temperature, TIE_BREAK) * gumbel per image,
    z the scores standardised over the image's patches (`sampled_keep_mask`)."""
    scores = scores.astype(jnp.float32)
    mean = jnp.mean(scores, axis=1, keepdims=True)
    std = jnp.std(scores, axis=1, keepdims=True)
    standardised = (scores - mean) / jnp.maximum(std, 1e-12)
    perturbed = standardised - max(temperature, TIE_BREAK) * gumbel
    kth_lowest = -jax.lax.top_k(-perturbed, count)[0][:, -1:]
    return perturbed <= kth_lowest


def object_patches(pixels, patch_size: int, threshold: float) -> jax.Array:
    """(B, N) True where a patch of `pixels` (B, H, W, C in [0, 1]) holds part of the object:
    a pixel above the dataset's `threshold` (specs.DatasetSpec.object_threshold)."""
    b, h, w, c = pixels.shape
    grid = pixels.reshape(b, h // patch_size, patch_size, w // patch_size, patch_size, c)
    return (grid.max(axis=(2, 4, 5)) > threshold).reshape(b, -1)


def preferred_first_scores(random_scores: jax.Array, preferred: jax.Array) -> jax.Array:
    """Random scores (B, N) in [0, 1) lowered by 1 on the `preferred` patches (B, N): the
    official rule, which occludes the lowest scores, then takes the preferred patches first,
    at random among them, and others only where an image has too few. The preferred patches
    are the object's (`rspc.selection='random_object'`, the control for a C that selects the
    object) or the most attended (`'attended'`, `'random_attended'`)."""
    return random_scores - preferred.astype(random_scores.dtype)


def gumbel_draws(rng: jax.Array, example_ids: jax.Array, num_patches: int) -> jax.Array:
    """Standard Gumbel noise (B, N) keyed by global example index (as `uniform_noise`)."""
    return jax.vmap(lambda i: jax.random.gumbel(jax.random.fold_in(rng, i), (num_patches,)))(
        example_ids
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def straight_through(scores: jax.Array, keep: jax.Array, clip: float | None, grad_scale: float):
    """Returns the hard mask `keep`; its gradient goes to `scores` as `grad_scale * g`,
    clipped to [-clip, clip] (official: clip = 1, torch hardtanh); `clip=None` gives the
    plain identity estimator."""
    return keep


def _straight_through_fwd(scores, keep, clip, grad_scale):
    return keep, None


def _straight_through_bwd(clip, grad_scale, _, g):
    scaled = g * grad_scale
    return (scaled if clip is None else jnp.clip(scaled, -clip, clip), jnp.zeros_like(g))


straight_through.defvjp(_straight_through_fwd, _straight_through_bwd)


def binarize(scores: jax.Array, rho: float, clip: float | None, grad_scale: float):
    """Straight-through binarisation by the official rule (`keep_mask`)."""
    return straight_through(scores, keep_mask(jax.lax.stop_gradient(scores), rho), clip, grad_scale)


def _ranks(values: jax.Array) -> jax.Array:
    """Per row, each entry's position in ascending order (0 = the lowest)."""
    return jnp.argsort(jnp.argsort(values, axis=1), axis=1)


def mixed_keep_mask(scores, learned_keep, random_scores, draws, fraction, batch_fraction):
    """1 = keep: C's mask `learned_keep` (B, N) with part of its occluded patches redrawn at
    random (`rspc.learned_fraction`, `learned_batch_fraction`; docs/method.md, "Mixed masks").

    Each image occludes as many patches as C's mask does (k). Of those, n come from C (the n
    of C's occluded patches it scores lowest) and k - n are drawn at random among the rest
    (the lowest `random_scores`), with n = floor(fraction * k + u) (u = draws[:, 0], so n is
    fraction * k exactly when that is whole and in expectation otherwise). Only the images
    with draws[:, 1] < batch_fraction use C at all; the others get a fully random mask.
    fraction = batch_fraction = 1 returns `learned_keep` unchanged.

    Returns (keep (B, N), learned_rows (B,) bool: the images whose mask C had a say in).
    """
    occluded = learned_keep < 0.5
    k = occluded.sum(axis=1, keepdims=True)
    learned_rows = draws[:, 1] < batch_fraction
    n = jnp.floor(fraction * k + draws[:, :1]).astype(k.dtype)
    n = jnp.where(learned_rows[:, None], jnp.clip(n, 0, k), 0)
    from_c = occluded & (_ranks(jnp.where(occluded, scores, jnp.inf)) < n)
    from_random = _ranks(jnp.where(from_c, jnp.inf, random_scores)) < k - n
    keep = ~(from_c | from_random)
    return keep.astype(learned_keep.dtype), learned_rows


def ramped_fraction(fraction: float, step, ramp_steps: int):
    """`fraction`, reached linearly from 0 over the first `ramp_steps` steps (HPM's schedule
    of its hard-patch share); `fraction` from the start when ramp_steps is 0."""
    if not ramp_steps:
        return jnp.asarray(fraction, jnp.float32)
    return fraction * jnp.minimum(1.0, jnp.asarray(step, jnp.float32) / ramp_steps)


def score_similarity(scores: jax.Array) -> jax.Array:
    """How alike C's scores are over the images of a batch, in [0, 1]: the mean over
    patches of the squared batch mean of each image's standardised scores (z over its
    patches). 1 when every image has the same pattern (C collapsed to fixed positions),
    about 1 / B when the images' patterns are independent."""
    scores = scores.astype(jnp.float32)
    mean = jnp.mean(scores, axis=1, keepdims=True)
    std = jnp.maximum(jnp.std(scores, axis=1, keepdims=True), 1e-12)
    return jnp.mean(jnp.mean((scores - mean) / std, axis=0) ** 2)


def diversity_loss(scores: jax.Array, weight: float) -> jax.Array:
    """-weight * B * N / 2 * score_similarity: added to the loss C ascends, it pushes each
    image's standardised score at each patch against that patch's batch mean, with a
    gradient of weight * (that batch mean) on each standardised score, on the scale of the
    official estimator's clipped (+-1) gradient. C (and only C) then spreads its choices
    over the batch (CL-MAE's batch diversity on the masker's output)."""
    batch, patches = scores.shape
    return -weight * batch * patches / 2 * score_similarity(scores)


def patch_mask_to_pixels(mask: jax.Array, grid: tuple[int, int], patch_size: int) -> jax.Array:
    """(B, N) per-patch mask -> (B, H, W, 1), each value repeated over its patch (F.fold)."""
    mask = mask.reshape(mask.shape[0], grid[0], grid[1], 1)
    return jnp.repeat(jnp.repeat(mask, patch_size, axis=1), patch_size, axis=2)


def occlude(images, pixel_keep, noise, lower=None, upper=None):
    """Eq. 1: keep-mask * image + (1 - mask) * noise, then clamp to [lower, upper] if given."""
    corrupted = images * pixel_keep + noise * (1.0 - pixel_keep)
    if lower is None:
        return corrupted
    return jnp.clip(corrupted, jnp.asarray(lower, images.dtype), jnp.asarray(upper, images.dtype))


def occlude_with_patch_mask(images, keep, noise, patch_size: int, lower=None, upper=None):
    """Eq. 1 with a per-patch keep-mask (B, N) over the row-major grid of `patch_size` patches."""
    grid = (images.shape[1] // patch_size, images.shape[2] // patch_size)
    pixel_keep = patch_mask_to_pixels(keep, grid, patch_size).astype(images.dtype)
    return occlude(images, pixel_keep, noise, lower, upper)


def normalized_limits(mean: Sequence[float], std: Sequence[float]):
    """Per-channel range of [0, 1] pixels after (x - mean) / std."""
    mean, std = jnp.asarray(mean, jnp.float32), jnp.asarray(std, jnp.float32)
    return (0.0 - mean) / std, (1.0 - mean) / std


def alignment_loss(
    block_outputs: Sequence[jax.Array], token_keep: jax.Array | None = None
) -> jax.Array:
    """Mean over blocks of mean((F_l(x_hat) - F_l(x))**2); each output is [corrupted; clean].

    With `token_keep` (B, patches) (the token-dropping ablation) the mean runs over the
    tokens the corrupted half kept; tokens before the patches (a class token) count as kept.
    """
    if not block_outputs:
        raise ValueError("the model sowed no block outputs; RSPC needs intermediates/block_outputs")
    per_block = []
    for features in block_outputs:
        corrupted, clean = jnp.split(features.astype(jnp.float32), 2, axis=0)
        squared = jnp.square(corrupted - clean)
        if token_keep is None:
            per_block.append(jnp.mean(squared))
            continue
        prefix = squared.shape[1] - token_keep.shape[1]
        keep = jnp.concatenate([jnp.ones_like(token_keep[:, :prefix]), token_keep], axis=1)
        weights = keep.astype(jnp.float32)[..., None]
        per_block.append((weights * squared).sum() / (weights.sum() * squared.shape[-1]))
    return jnp.mean(jnp.stack(per_block))


def per_example_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """(B,) CE of logits computed in float32 (or wider) against integer labels (B,) or soft
    targets (B, K) (one-hot, smoothed or mixed); the package's one cross-entropy."""
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    if targets.ndim < logits.ndim:
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return optax.softmax_cross_entropy(logits, targets)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean CE over the batch (`per_example_cross_entropy`)."""
    return jnp.mean(per_example_cross_entropy(logits, targets))


def uniform_noise(rng: jax.Array, example_ids: jax.Array, image_shape) -> jax.Array:
    """U[0,1) noise per pixel and channel, keyed by global example index.

    Keying by example (not by device) makes the noise independent of how the global
    batch is split over devices, so the sharded step equals the single-device step.
    """
    return jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(rng, i), image_shape))(
        example_ids
    )


def corrupt_batch(
    corruption_params,
    images,
    noise,
    *,
    corruption_model,
    rho,
    ste_clip,
    grad_scale,
    lower,
    upper,
    random_scores=None,
    mask_probe=None,
    sampling=None,
    mixing=None,
    patch_size=None,
):
    """Builds x_hat = C-selected occlusion of `images`; returns (x_hat, keep-mask (B, N)).

    `random_scores` replaces C's scores (the random-selection ablation, Table 3, and every
    selection of SELECTIONS that is not C's); with `corruption_model` None (a selection that
    builds no C) they are the only scores, and `patch_size` (else C's) sizes the patches.
    `mask_probe` (zeros (B, N)) is added to the mask so that its gradient exposes the
    gradient reaching the STE (for the saturation diagnostics).
    `sampling` (gumbel draws (B, N), temperature) selects by `sampled_keep_mask` instead of
    the official quantile rule.
    `mixing` (random scores (B, N), uniform draws (B, 2), fraction, batch fraction) redraws
    part of C's mask at random (`mixed_keep_mask`); C's gradient then comes only from the
    images whose mask it had a say in.
    """
    if random_scores is not None:
        scores = random_scores
    else:
        scores = corruption_model.apply({"params": corruption_params}, images)
    fixed = jax.lax.stop_gradient(scores)
    if sampling is None:
        hard = keep_mask(fixed, rho)
    else:
        hard = sampled_keep_mask(fixed, rho, *sampling)
    if mixing is not None:
        hard, learned_rows = mixed_keep_mask(fixed, hard, *mixing)
        scores = jnp.where(learned_rows[:, None], scores, fixed)
    mask = straight_through(scores, hard, ste_clip, grad_scale)
    if mask_probe is not None:
        mask = mask + mask_probe
    corrupted = occlude_with_patch_mask(
        images, mask, noise, patch_size or corruption_model.patch_size, lower, upper
    )
    return corrupted, mask


def apply_model(model, params, batch_stats, images, *, compute_dtype=None, **kwargs):
    """`model.apply` on float32 master parameters. With `compute_dtype` (bfloat16 on TPU)
    parameters and images are cast for the forward pass only: gradients flow back to the
    float32 parameters, BatchNorm statistics stay float32, and flax's norms reduce in
    float32. Logits and block outputs come back in `compute_dtype`; the losses upcast."""
    if compute_dtype is not None:
        params = jax.tree.map(lambda p: p.astype(compute_dtype), params)
        images = images.astype(compute_dtype)
    return model.apply({"params": params, "batch_stats": batch_stats}, images, **kwargs)


def rspc_loss(
    params,
    corruption_params,
    batch_stats,
    images,
    targets,
    noise,
    *,
    model,
    corruption_model,
    rho,
    lam,
    ste_clip,
    grad_scale,
    lower,
    upper,
    rngs,
    align_blocks=None,
    random_scores=None,
    mask_probe=None,
    compute_dtype=None,
    objective="align",
    drop_tokens=False,
    sampling=None,
    mixing=None,
    patch_size=None,
):
    """CE(clean) + lam * L_align from ONE forward pass over [x_hat; x] (official order).

    BatchNorm statistics (if the model has any) therefore span both halves, as in the
    official DDP code. Returns (total, aux): aux holds the parts (`align`, or `occluded_ce`
    for objective='ce') and the new state. objective='ce' (ablation) replaces L_align by CE
    on the occluded images: C ascends lam * CE(x_hat), the classifier trains on clean and
    occluded data. drop_tokens (ablation, models with `supports_token_dropping`): the
    selected patches are dropped from the corrupted half's token sequence instead of filled
    with noise (the model's `token_keep`; C's gradient flows through it), and L_align runs
    over the kept tokens. sampling, mixing, patch_size: see `corrupt_batch`.
    """
    corrupted, mask = corrupt_batch(
        corruption_params,
        images,
        noise,
        corruption_model=corruption_model,
        rho=rho,
        ste_clip=ste_clip,
        grad_scale=grad_scale,
        lower=lower,
        upper=upper,
        random_scores=random_scores,
        mask_probe=mask_probe,
        sampling=sampling,
        mixing=mixing,
        patch_size=patch_size,
    )
    token_keep, kwargs = None, {}
    if drop_tokens:
        corrupted, token_keep = images, mask
        kwargs = dict(token_keep=jnp.concatenate([mask, jnp.ones_like(mask)]))
    logits, state = apply_model(
        model,
        params,
        batch_stats,
        jnp.concatenate([corrupted, images]),
        compute_dtype=compute_dtype,
        train=True,
        mutable=["intermediates", "batch_stats"],
        rngs=rngs,
        **kwargs,
    )
    corrupted_logits, clean_logits = jnp.split(logits, 2)
    ce = cross_entropy(clean_logits, targets)
    aux = dict(ce=ce, logits=clean_logits, keep=mask, batch_stats=state.get("batch_stats", {}))
    if objective == "ce":
        aux["occluded_ce"] = term = cross_entropy(corrupted_logits, targets)
    else:
        block_outputs = state["intermediates"]["block_outputs"]
        if align_blocks is not None:
            block_outputs = [block_outputs[i] for i in align_blocks]
        aux["align"] = term = alignment_loss(block_outputs, token_keep)
    return ce + lam * term, aux


def plain_loss(params, batch_stats, images, targets, *, model, rngs, compute_dtype=None):
    """The baseline (rspc.enabled = False): CE on the clean batch through the same loop."""
    logits, state = apply_model(
        model,
        params,
        batch_stats,
        images,
        compute_dtype=compute_dtype,
        train=True,
        mutable=["batch_stats"],
        rngs=rngs,
    )
    ce = cross_entropy(logits, targets)
    return ce, dict(ce=ce, logits=logits, batch_stats=state.get("batch_stats", {}))


# --------------------------------------------------------------------------------------
# The corruption model's optimizer and the settings a run config resolves to


def negate_finite() -> optax.GradientTransformation:
    """grad <- -nan_to_num(grad, 0, 0, 0): the official `reverse_grad`, turning SGD into ascent."""
    return optax.stateless(
        lambda updates, _: jax.tree.map(
            lambda g: -jnp.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0), updates
        )
    )


def corruption_optimizer(
    config, warmup_steps: int = 0, curriculum_steps: int = 0
) -> optax.GradientTransformation:
    """Gradient *ascent* for C in the official order.

    clip to global norm -> negate (NaN/Inf -> 0) -> coupled L2 weight decay (torch SGD
    adds wd * param after the negation, so decay still shrinks C) -> Nesterov momentum
    SGD at a constant learning rate. With a schedule (`corruption_direction`, not in the
    paper) C's clipped gradient is first multiplied by its value; without one the chain is
    the official one, state and all.
    """
    schedule = ()
    if warmup_steps or curriculum_steps:
        schedule = (optax.scale_by_schedule(corruption_direction(warmup_steps, curriculum_steps)),)
    return optax.chain(
        optax.clip_by_global_norm(config.clip_norm),
        *schedule,
        negate_finite(),
        optax.add_decayed_weights(config.weight_decay),
        optax.sgd(config.lr, momentum=config.momentum, nesterov=config.nesterov),
    )


def corruption_direction(warmup_steps: int, curriculum_steps: int):
    """fn(C's update count) -> the factor on C's gradient (`rspc.corruption_warmup_epochs`,
    `corruption_curriculum_epochs`; docs/method.md, "A schedule on C's objective"): 0 for
    the first `warmup_steps` (the classifier learns before C moves), then from -1 to +1
    linearly over `curriculum_steps` (C first descends the loss, helping, then ascends it,
    CL-MAE's curriculum), then 1 (the official ascent)."""

    def factor(count):
        t = jnp.asarray(count, jnp.float32) - warmup_steps
        ramp = jnp.clip(2.0 * t / max(curriculum_steps, 1) - 1.0, -1.0, 1.0)
        return jnp.where(t < 0, 0.0, ramp if curriculum_steps else 1.0)

    return factor


def selection_temperature(rspc_config) -> float | None:
    """None for the official quantile rule (the official C at temperature 0); else the
    temperature of `sampled_keep_mask`, which the content C always uses (its scores of
    identical patches tie, and the quantile rule would occlude every tied patch)."""
    if rspc_config.selection != "learned":
        return None
    if rspc_config.corruption_model == "official" and rspc_config.temperature == 0:
        return None
    return float(rspc_config.temperature)


def mixed_masks(rspc_config) -> bool:
    """Whether C's masks are partly redrawn at random (`mixed_keep_mask`): any of the three
    switches away from its default, and C selecting at all."""
    r = rspc_config
    mixed = r.learned_fraction < 1 or r.learned_fraction_ramp_epochs > 0
    return r.selection == "learned" and (mixed or r.learned_batch_fraction < 1)


def corruption_patch_size(rspc_config, model) -> int:
    """C's patch size: `rspc.patch_size`, or 0 for the model's token size."""
    return rspc_config.patch_size or model.patch_size


def occlusion_fill(rspc_config, mean: Sequence[float], std: Sequence[float]):
    """(noise_mean, noise_std, lower, upper) of eq. 1 for a dataset normalised with
    (`mean`, `std`): U[0,1) noise in normalised space (official) or in pixel space, then a
    clamp to the ImageNet-normalised or the dataset's normalised [0,1] range, or none."""
    if rspc_config.noise_space == "pixel":
        noise_mean, noise_std = tuple(mean), tuple(std)
    else:
        noise_mean, noise_std = (0.0,), (1.0,)
    lower = upper = None
    if rspc_config.clamp != "none":
        clamp_mean, clamp_std = (
            (IMAGENET_MEAN, IMAGENET_STD) if rspc_config.clamp == "imagenet" else (mean, std)
        )
        lower, upper = (
            tuple(float(v) for v in np.asarray(a)) for a in normalized_limits(clamp_mean, clamp_std)
        )
    return noise_mean, noise_std, lower, upper


@dataclasses.dataclass(frozen=True)
class Settings:
    """RSPC's static settings, resolved from `config.rspc` and the dataset once
    (`settings_from_config`). The train step holds them whole (StepSettings.rspc) and hands
    them to the objective, so that a new switch is a field here, its default
    (training/defaults.py) and its check, and the step and its setup stay as they are."""

    enabled: bool
    rho: float
    lam: float
    ste_clip: float | None  # None: the identity STE
    grad_scale: float  # the emulated AMP loss scale on C's gradient
    noise_mean: tuple  # noise = (u - mean) / std; (0,)/(1,) = normalised-space noise
    noise_std: tuple
    clamp_lower: tuple | None  # None = no clamp
    clamp_upper: tuple | None
    selection: str  # a name of SELECTIONS
    patch_size: int  # 0 = the model's token size (`corruption_patch_size`)
    align_blocks: tuple | None  # None = all blocks
    objective: str  # 'align' (eq. 2) | 'ce' (CE on the occluded images; ablation)
    fill: str  # 'noise' (eq. 1) | 'zero' | 'drop'
    pixel_mean: tuple  # the dataset's normalisation, to find its object's pixels
    pixel_std: tuple
    object_threshold: float | None  # pixels above it hold the object, where a dataset says so
    temperature: float | None  # None: the official quantile rule (`selection_temperature`)
    mixed_masks: bool  # C's masks partly redrawn at random (`mixed_masks`)
    learned_fraction: float
    learned_fraction_ramp_steps: int
    learned_batch_fraction: float
    diversity: float  # the weight of `diversity_loss`; 0 = official
    attended_pool: float = 2.0  # m / k of 'random_attended' (`attended_pool`)


def settings_from_config(config, spec, steps_per_epoch: int = 1) -> Settings:
    """`config.rspc` resolved for a dataset `spec` (its mean, std and object_threshold);
    `steps_per_epoch` turns the switches given in epochs into steps."""
    r = config.rspc
    noise_mean, noise_std, lower, upper = occlusion_fill(r, spec.mean, spec.std)
    return Settings(
        enabled=r.enabled,
        rho=r.rho,
        lam=r.lam,
        ste_clip=1.0 if r.ste == "clip" else None,
        grad_scale=r.corruption_grad_scale,
        noise_mean=noise_mean,
        noise_std=noise_std,
        clamp_lower=lower,
        clamp_upper=upper,
        selection=r.selection,
        patch_size=r.patch_size,
        align_blocks=tuple(r.align_blocks) or None,
        objective=r.objective,
        fill=r.fill,
        pixel_mean=tuple(spec.mean),
        pixel_std=tuple(spec.std),
        object_threshold=spec.object_threshold,
        temperature=selection_temperature(r),
        mixed_masks=mixed_masks(r),
        learned_fraction=float(r.learned_fraction),
        learned_fraction_ramp_steps=round(r.learned_fraction_ramp_epochs * steps_per_epoch),
        learned_batch_fraction=float(r.learned_batch_fraction),
        diversity=float(r.corruption_diversity),
        attended_pool=float(r.attended_pool),
    )


# --------------------------------------------------------------------------------------
# Selections: which patches of an image are occluded (`rspc.selection`)


@dataclasses.dataclass(frozen=True)
class SelectionBatch:
    """What a selection may look at of one micro-batch: its (normalised) images, their
    global indices (random draws are keyed by them, as the noise is), the step's selection
    key and step, the patches' size, and the classifier as it is at this step."""

    images: jax.Array
    example_ids: jax.Array
    rng: jax.Array
    step: jax.Array
    patch_size: int
    model: Any
    params: Any
    batch_stats: Any
    compute_dtype: Any = None

    @property
    def num_patches(self) -> int:
        height, width = self.images.shape[1:3]
        return (height // self.patch_size) * (width // self.patch_size)


class Draws(NamedTuple):
    """A selection's inputs to `corrupt_batch`: scores that replace C's (None: C's own),
    Gumbel draws and temperature of sampled masks, and the `mixing` of mixed masks."""

    scores: jax.Array | None = None
    sampling: tuple | None = None
    mixing: tuple | None = None


@dataclasses.dataclass(frozen=True)
class Selection:
    """One value of `rspc.selection`: `draw(settings, batch) -> Draws`, whether the run
    builds a corruption model C (trained only where `draw` lets C's scores choose), and
    whether it reads the classifier's attention (`ATTENTION_OF` must know the model)."""

    draw: Callable[[Settings, SelectionBatch], Draws]
    corruption_model: bool
    attention: bool = False


def _learned(settings: Settings, batch: SelectionBatch) -> Draws:
    """C's masks: the official quantile rule, Gumbel top-k at a temperature, mixed masks."""
    sampling = None
    if settings.temperature is not None:
        rng = jax.random.fold_in(batch.rng, 1)
        sampling = (gumbel_draws(rng, batch.example_ids, batch.num_patches), settings.temperature)
    return Draws(sampling=sampling, mixing=_mixing(settings, batch))


def _mixing(settings: Settings, batch: SelectionBatch):
    """The `mixing` of `corrupt_batch` (random scores, uniform draws, C's fraction of the
    occluded patches at this step, batch fraction), or None where C's masks are used whole."""
    if not settings.mixed_masks:
        return None
    rng = jax.random.fold_in(batch.rng, 2)
    scores = uniform_noise(rng, batch.example_ids, (batch.num_patches,))
    draws = uniform_noise(jax.random.fold_in(rng, 1), batch.example_ids, (2,))
    fraction = ramped_fraction(
        settings.learned_fraction, batch.step, settings.learned_fraction_ramp_steps
    )
    return scores, draws, fraction, settings.learned_batch_fraction


def _random_scores(batch: SelectionBatch) -> jax.Array:
    """U[0,1) scores (B, N), keyed by example: under the official rule, random masks."""
    return uniform_noise(batch.rng, batch.example_ids, (batch.num_patches,))


def _random(settings: Settings, batch: SelectionBatch) -> Draws:
    """Random masks (Table 3's ablation)."""
    return Draws(scores=_random_scores(batch))


def on_object(settings: Settings, images, patch_size: int) -> jax.Array:
    """(B, N) True where a patch of the normalised `images` holds part of the object (the
    dataset's object_threshold)."""
    pixels = images * jnp.asarray(settings.pixel_std) + jnp.asarray(settings.pixel_mean)
    return object_patches(pixels, patch_size, settings.object_threshold)


def _random_object(settings: Settings, batch: SelectionBatch) -> Draws:
    """Random masks on the object's patches first (the control for a C that selects it)."""
    preferred = on_object(settings, batch.images, batch.patch_size)
    return Draws(scores=preferred_first_scores(_random_scores(batch), preferred))


# --------------------------------------------------------------------------------------
# Occluding what the classifier attends to (`rspc.selection='attended'`, 'random_attended';
# docs/method.md, "Occluding what the classifier attends to")


def _class_token_row(maps) -> jax.Array:
    """(B, heads, queries, 1 + N) maps whose token 0 is the class token -> the class token's
    attention to the N patches (B, N), mean over heads."""
    return jnp.mean(maps[:, :, 0, 1:].astype(jnp.float32), axis=1)


def _received(maps) -> jax.Array:
    """(B, heads, N, N) -> the attention each token receives (B, N), mean over heads and
    queries: a model without a class token pools every token alike, so every query counts."""
    return jnp.mean(maps.astype(jnp.float32), axis=(1, 2))


def _last_class_attention(model, intermediates) -> jax.Array:
    """CaiT, XCiT, FAN: the class token's row in the last class-attention block."""
    return _class_token_row(intermediates["class_attention_maps"][-1])


def _vit_attention(model, intermediates) -> jax.Array:
    """ViT/DeiT: the class token's row in the last block, or (pool='avg', no class token)
    the attention each patch receives there."""
    maps = intermediates["attention_maps"][-1]
    return _class_token_row(maps) if model.pool == "token" else _received(maps)


def _rvt_attention(model, intermediates) -> jax.Array:
    """RVT (no class token, the head averages the last stage): the attention each token
    receives in the last block."""
    return _received(intermediates["attention_maps"][-1])


# Per model family (its class name): fn(model, intermediates sown with sow_attention=True)
# -> (B, T) how much the classifier attends to each token of the last layer that attends over
# the image's tokens, row-major over that layer's token grid.
ATTENTION_OF = {
    "ViT": _vit_attention,
    "RVT": _rvt_attention,
    "CaiT": _last_class_attention,
    "XCiT": _last_class_attention,
    "FAN": _last_class_attention,
}


def _on_patch_grid(per_token: jax.Array, grid: tuple[int, int]) -> jax.Array:
    """(B, T) over a token grid of the images' aspect -> (B, gh * gw) over the patch `grid`:
    the same grid, or one that each token covers with f x f patches (RVT's pooled last stage
    repeats its values)."""
    batch, tokens = per_token.shape
    rows = round(math.sqrt(tokens * grid[0] / grid[1]))
    cols = tokens // max(rows, 1)
    if rows * cols != tokens or grid[0] % rows or grid[1] % cols:
        raise ValueError(
            f"the attention's {tokens} tokens form no grid that the {grid[0]}x{grid[1]} "
            "patches tile; attention selections need rspc.patch_size at 0 (the model's tokens)"
        )
    values = per_token.reshape(batch, rows, 1, cols, 1)
    values = jnp.broadcast_to(values, (batch, rows, grid[0] // rows, cols, grid[1] // cols))
    return values.reshape(batch, grid[0] * grid[1])


def clean_attention(batch: SelectionBatch) -> jax.Array:
    """(B, N) the classifier's attention to each patch of the clean images (`ATTENTION_OF`),
    under stop-gradient. It takes one extra forward pass over the clean images in evaluation
    mode (no dropout, BatchNorm's running statistics, nothing updated): the step's one pass
    over [x_hat; x] cannot give it, since x_hat is built from it."""
    _, state = apply_model(
        batch.model,
        jax.lax.stop_gradient(batch.params),
        jax.lax.stop_gradient(batch.batch_stats),
        batch.images,
        compute_dtype=batch.compute_dtype,
        train=False,
        sow_attention=True,
        mutable=["intermediates"],
    )
    per_token = ATTENTION_OF[type(batch.model).__name__](batch.model, state["intermediates"])
    grid = (batch.images.shape[1] // batch.patch_size, batch.images.shape[2] // batch.patch_size)
    return jax.lax.stop_gradient(_on_patch_grid(per_token, grid))


def attended_pool(settings: Settings, num_patches: int) -> int:
    """m, the most attended patches among which 'random_attended' draws its k: round(pool * k),
    at least k and at most every patch."""
    k = num_occluded(num_patches, settings.rho)
    return min(num_patches, max(k, round(settings.attended_pool * k)))


def most_attended_first(attention, m: int, ties, random_scores) -> jax.Array:
    """Scores under which the official rule occludes k patches at random among the m that
    `attention` (B, N) ranks highest (`preferred_first_scores`); exact ties of attention
    (RVT's repeated values) broken by the Gumbel draws `ties` (B, N), not by position."""
    most_attended = lowest_patches(-attention, m, ties, 0.0)
    return preferred_first_scores(random_scores, most_attended)


def _within_most_attended(batch: SelectionBatch, m: int) -> Draws:
    """k of the m most attended patches at random (`most_attended_first`), the tie draws and
    the random scores keyed by example (fold 3 of the selection key: the others are taken)."""
    ties = gumbel_draws(jax.random.fold_in(batch.rng, 3), batch.example_ids, batch.num_patches)
    scores = most_attended_first(clean_attention(batch), m, ties, _random_scores(batch))
    return Draws(scores=scores)


def _attended(settings: Settings, batch: SelectionBatch) -> Draws:
    """The k patches the classifier attends to most (AttMask's hardest masking)."""
    return _within_most_attended(batch, num_occluded(batch.num_patches, settings.rho))


def _random_attended(settings: Settings, batch: SelectionBatch) -> Draws:
    """k patches at random among the m it attends to most (`attended_pool`)."""
    return _within_most_attended(batch, attended_pool(settings, batch.num_patches))


SELECTIONS = {
    "learned": Selection(_learned, corruption_model=True),
    # The random selections build a C that is never trained (checkpoints have always held one).
    "random": Selection(_random, corruption_model=True),
    "random_object": Selection(_random_object, corruption_model=True),
    "attended": Selection(_attended, corruption_model=False, attention=True),
    "random_attended": Selection(_random_attended, corruption_model=False, attention=True),
}


def draw_selection(settings: Settings, batch: SelectionBatch) -> Draws:
    """The inputs of `corrupt_batch` for the selection `settings` name."""
    return SELECTIONS[settings.selection].draw(settings, batch)


def corruption_model_for(rspc_config, model) -> nn.Module | None:
    """The run's C (`make_corruption_model` at `corruption_patch_size`), or None where the run
    has none: RSPC off, or a selection that builds none."""
    if not (rspc_config.enabled and SELECTIONS[rspc_config.selection].corruption_model):
        return None
    return make_corruption_model(rspc_config, corruption_patch_size(rspc_config, model))


def occlusion_noise(settings: Settings, rng, example_ids, images) -> jax.Array:
    """The fill of occluded patches: uniform noise per example (eq. 1), or zeros ('zero';
    'drop' never shows the filled image)."""
    if settings.fill != "noise":
        return jnp.zeros_like(images)
    uniform = uniform_noise(rng, example_ids, images.shape[1:])
    return (uniform - jnp.asarray(settings.noise_mean)) / jnp.asarray(settings.noise_std)


# --------------------------------------------------------------------------------------
# Checks of config.rspc that need the dataset or the model (the fields' ranges and choices
# are checked earlier, without JAX, by training/checks.py)


def check_dataset(rspc_config, spec, dataset: str) -> None:
    """Random patches on the object need a dataset whose `spec` says which pixels are the
    object."""
    if not (rspc_config.enabled and rspc_config.selection == "random_object"):
        return
    if spec.object_threshold is None:
        raise ConfigError(
            f"rspc.selection='random_object' occludes random patches of the object, but dataset "
            f"{dataset!r} does not say which pixels are its object (its spec has no "
            "object_threshold). Use it on the digits datasets, or use rspc.selection='random'."
        )


def check_model(rspc_config, model, model_name: str) -> None:
    """Token dropping has a model that supports it, with one RSPC patch per token; a
    selection that reads the classifier's attention has a model whose attention
    `ATTENTION_OF` knows, over patches that are its tokens."""
    if rspc_config.enabled and SELECTIONS[rspc_config.selection].attention:
        _check_attention(rspc_config, model, model_name)
    if rspc_config.enabled and rspc_config.fill == "drop":
        _check_token_dropping(rspc_config, model, model_name)


def _check_attention(rspc_config, model, model_name: str) -> None:
    family = type(model).__name__
    if family not in ATTENTION_OF:
        raise ConfigError(
            f"rspc.selection={rspc_config.selection!r} occludes the patches the classifier "
            f"attends to most, read from its attention maps, but {model_name} ({family}) has "
            "no attention over the whole image that says where it looks: Swin attends within "
            "(shifted) windows, so its maps rank a token only against the others of its "
            "window. The families that have one are ViT/DeiT and RVT (the last block) and "
            "CaiT, XCiT and FAN (the last class-attention block; docs/method.md, 'Occluding "
            "what the classifier attends to'). Train one of those, or use "
            "rspc.selection='random' or 'learned'; to add a family, give rspc.ATTENTION_OF a "
            "function from its sown maps to one score per token."
        )
    if corruption_patch_size(rspc_config, model) != model.patch_size:
        raise ConfigError(
            f"rspc.selection={rspc_config.selection!r} ranks the model's tokens, so its "
            f"patches must be the tokens ({model.patch_size} px), not rspc.patch_size="
            f"{rspc_config.patch_size}; leave rspc.patch_size at 0."
        )


def _check_token_dropping(rspc_config, model, model_name: str) -> None:
    if not getattr(model, "supports_token_dropping", False):
        raise ConfigError(
            f"config.rspc.fill='drop' removes tokens from the sequence, which {model_name} "
            "cannot do (RVT, FAN and XCiT mix tokens with convolutions on the token grid); "
            "use a ViT/DeiT model or fill='noise'/'zero'"
        )
    if corruption_patch_size(rspc_config, model) != model.patch_size:
        raise ConfigError(
            f"config.rspc.fill='drop' needs rspc.patch_size equal to the model's "
            f"token size {model.patch_size}; leave rspc.patch_size at 0"
        )
