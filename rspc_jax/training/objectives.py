"""The training objectives: one loss function each, with one signature, chosen by name.

Every loss is called as

    loss(ctx, params, corruption_params, mask_probe, batch_stats, images, noise_rng, rngs)

on one micro-batch and returns (loss, aux), aux holding at least `ce`, `logits` and the new
`batch_stats`. `corruption_params` and `mask_probe` are the extra differentiable inputs that
an objective declares with `extra_inputs` (RSPC: the corruption model C's parameters, which
the step updates with C's optimizer, and a zero probe whose gradient is the one reaching the
straight-through estimator); the others get ({}, None) and ignore them. Each objective's
`metrics` turns its aux into its own metrics and the masks whose selection statistics the
step reports. Everything else (micro-batches, collectives, updates) is the step's
(training/step.py).

Adding an objective: one loss function and one line in OBJECTIVES (and, for a new switch,
one line in `name_of`). RSPC's own switches (a selection, a remedy) live in rspc.py: its
settings (`rspc.Settings`, StepSettings.rspc) and its selections (`rspc.SELECTIONS`).
"""

from collections.abc import Callable
import dataclasses
import difflib
from typing import Any

import jax
import jax.numpy as jnp

from rspc_jax import ConfigError, rspc
from rspc_jax.training import adversarial as adversarial_training
from rspc_jax.training import patch_aug


@dataclasses.dataclass(frozen=True)
class Context:
    """What a loss sees of one micro-batch besides its differentiable inputs."""

    model: Any
    corruption_model: Any  # C (None when no objective trains one)
    settings: Any  # training.step.StepSettings
    step: jax.Array
    select_rng: jax.Array  # random masks and Gumbel draws of C's masks
    targets: jax.Array  # (B, K) soft targets (one-hot, smoothed or mixed)
    example_ids: jax.Array  # (B,) global indices: noise, masks and attack starts are keyed by them


@dataclasses.dataclass(frozen=True)
class Objective:
    loss: Callable  # the common signature above -> (loss, aux)
    metrics: Callable  # (ctx, images, aux, mask_probe_grad) -> (metrics, chosen masks)
    # (ctx, C's params, images) -> (corruption_params, mask_probe); None: the classifier's
    # parameters are the only differentiable input.
    extra_inputs: Callable | None = None


# ---------------------------------------------------------------------------------------
# RSPC (and its ablations: clean + corrupted, random or sampled masks, zero fill, dropping)


def _patch_size(ctx: Context) -> int:
    return rspc.corruption_patch_size(ctx.settings.rspc, ctx.model)


def rspc_objective(
    ctx, params, corruption_params, mask_probe, batch_stats, images, noise_rng, rngs
):
    """CE(clean) + lam * L_align (or lam * CE(occluded): `rspc.objective='ce'`), the patches
    chosen by `rspc.selection` (`rspc.draw_selection`), C ascending where it chooses them;
    with `rspc.corruption_diversity` C also ascends `rspc.diversity_loss` on its scores
    (aux['added_loss']: in the gradient only, and only C's)."""
    s = ctx.settings.rspc
    batch = rspc.SelectionBatch(
        images=images,
        example_ids=ctx.example_ids,
        rng=ctx.select_rng,
        step=ctx.step,
        patch_size=_patch_size(ctx),
        model=ctx.model,
        params=params,
        batch_stats=batch_stats,
        compute_dtype=ctx.settings.compute_dtype,
    )
    draws = rspc.draw_selection(s, batch)
    value, aux = rspc.rspc_loss(
        params,
        corruption_params,
        batch_stats,
        images,
        ctx.targets,
        rspc.occlusion_noise(s, noise_rng, ctx.example_ids, images),
        model=ctx.model,
        corruption_model=ctx.corruption_model,
        rho=s.rho,
        lam=s.lam,
        ste_clip=s.ste_clip,
        grad_scale=s.grad_scale,
        lower=s.clamp_lower,
        upper=s.clamp_upper,
        align_blocks=s.align_blocks,
        random_scores=draws.scores,
        sampling=draws.sampling,
        mixing=draws.mixing,
        patch_size=batch.patch_size,
        compute_dtype=ctx.settings.compute_dtype,
        objective=s.objective,
        drop_tokens=s.fill == "drop",
        rngs=rngs,
        mask_probe=mask_probe,
    )
    if s.diversity > 0 and s.selection == "learned":
        scores = ctx.corruption_model.apply({"params": corruption_params}, images)
        aux["added_loss"] = rspc.diversity_loss(scores, s.diversity)
        aux["score_similarity"] = rspc.score_similarity(jax.lax.stop_gradient(scores))
    return value, aux


def rspc_inputs(ctx: Context, corruption_params, images):
    """C's parameters and a zero probe added to its (B, N) mask."""
    size = _patch_size(ctx)
    num_patches = (images.shape[1] // size) * (images.shape[2] // size)
    return corruption_params, jnp.zeros((images.shape[0], num_patches), jnp.float32)


def _chosen_masks(ctx: Context, images, keep):
    """C's masks, for the statistics of its selection over the global batch (and which
    patches hold the object, where the dataset says)."""
    s = ctx.settings.rspc
    chosen = {"occluded": (1 - keep).astype(jnp.int8)}
    if s.object_threshold is not None:
        chosen["on_object"] = rspc.on_object(s, images, _patch_size(ctx))
    return chosen


def rspc_metrics(ctx: Context, images, aux, mask_probe_grad):
    """The term C ascends besides CE (L_align or CE on the occluded images), the occluded
    fraction, how often the STE clip saturates, and the align term's weight against CE."""
    s = ctx.settings.rspc
    metrics = {k: aux[k] for k in ("align", "occluded_ce", "score_similarity") if k in aux}
    saturated = jnp.abs(mask_probe_grad * s.grad_scale) >= (s.ste_clip or jnp.inf)
    metrics.update(
        occluded_fraction=1.0 - jnp.mean(aux["keep"]),
        ste_saturated_fraction=jnp.mean(saturated),
    )
    if "align" in aux:
        metrics["weighted_align_to_ce"] = s.lam * aux["align"] / aux["ce"]
    return metrics, _chosen_masks(ctx, images, aux["keep"])


# ---------------------------------------------------------------------------------------
# The baselines


def plain_objective(
    ctx, params, corruption_params, mask_probe, batch_stats, images, noise_rng, rngs
):
    """CE on the clean batch (rspc.enabled=False)."""
    return rspc.plain_loss(
        params,
        batch_stats,
        images,
        ctx.targets,
        model=ctx.model,
        rngs=rngs,
        compute_dtype=ctx.settings.compute_dtype,
    )


def no_metrics(ctx, images, aux, mask_probe_grad):
    return {}, {}


def adversarial_objective(
    ctx, params, corruption_params, mask_probe, batch_stats, images, noise_rng, rngs
):
    """FGSM, PGD or TRADES (config.adversarial.method); `noise_rng` keys the random starts."""
    s = ctx.settings
    return adversarial_training.adversarial_loss(
        params,
        batch_stats,
        images,
        ctx.targets,
        noise_rng,
        ctx.example_ids,
        ctx.step,
        model=ctx.model,
        settings=s.adversarial,
        mean=s.pixel_mean,
        std=s.pixel_std,
        rngs=rngs,
        compute_dtype=s.compute_dtype,
    )


def adversarial_metrics(ctx, images, aux, mask_probe_grad):
    """The attack budget of this step, and TRADES' KL term."""
    return {k: aux[k] for k in ("eps", "robust_kl") if k in aux}, {}


OBJECTIVES = {
    "rspc": Objective(rspc_objective, rspc_metrics, extra_inputs=rspc_inputs),
    "plain": Objective(plain_objective, no_metrics),
    "adversarial": Objective(adversarial_objective, adversarial_metrics),
}


def name_of(settings) -> str:
    """The objective a run's StepSettings select."""
    if settings.rspc.enabled:
        return "rspc"
    return "plain" if settings.adversarial is None else "adversarial"


def get(name: str) -> Objective:
    """Registered objective `name`; unknown names fail listing the valid ones."""
    if name not in OBJECTIVES:
        close = difflib.get_close_matches(name, OBJECTIVES, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(
            f"unknown objective {name!r}.{hint} Registered objectives: {', '.join(sorted(OBJECTIVES))}."
        )
    return OBJECTIVES[name]


def with_patch_aug(loss: Callable, mode: str, key, aug_noise_rng) -> Callable:
    """`loss` (the common signature) preceded by a pass on the patch-augmented batch, as
    RSPC_RVT runs the whole step on it first (its own mask, noise and dropout: `key` draws
    the augmentation and the dropout, `aug_noise_rng` the noise), then on the clean batch,
    which sees the BatchNorm statistics it left. Its gradients are discarded ('official':
    only the statistics keep it) or, as intended, added: its loss is then aux['added_loss'],
    which the step adds to the loss it differentiates."""

    def augmented(ctx, params, corruption_params, mask_probe, batch_stats, images, noise_rng, rngs):
        s = ctx.settings
        aug_images = patch_aug.patch_augment(
            key, images, ctx.model.patch_size, s.rspc.clamp_lower, s.rspc.clamp_upper
        )
        aug_inputs = (params, corruption_params)
        if mode == "official":
            aug_inputs = jax.lax.stop_gradient(aug_inputs)
        aug_dropout = {"dropout": jax.random.fold_in(key, 1)}
        aug_loss, aug_aux = loss(
            ctx, *aug_inputs, None, batch_stats, aug_images, aug_noise_rng, aug_dropout
        )
        value, aux = loss(
            ctx,
            params,
            corruption_params,
            mask_probe,
            aug_aux["batch_stats"],
            images,
            noise_rng,
            rngs,
        )
        if mode == "intended":
            aux = {**aux, "added_loss": aux.get("added_loss", 0.0) + aug_loss}
        return value, aux

    return augmented
