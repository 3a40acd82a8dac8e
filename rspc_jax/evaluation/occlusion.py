"""Random patch occlusion and attention stability (paper Sec. 1, 5.1; Figs. 2, 4, 5).

Definitions (docs/evaluation.md, "Occlusion and attention stability"; the paper leaves them open):
* a random occlusion mask occludes exactly `num_occluded(N, rho)` of the N patches of an
  image (the training count: 20 of 196 at rho = 0.1), chosen uniformly without
  replacement; occluded patches get the training noise (U[0,1) in normalised space by
  default) and the training clamp;
* attention Cos-Sim of an image = mean over layers and heads of the cosine similarity of
  the whole flattened post-softmax attention map (N x N) clean vs occluded.
"""

from collections.abc import Callable, Sequence
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

from rspc_jax import rspc


def random_keep_masks(rng: jax.Array, batch: int, num_patches: int, occluded: int) -> jax.Array:
    """(batch, N) float keep-masks, each with exactly `occluded` zeros at random places."""
    order = jnp.argsort(jax.random.uniform(rng, (batch, num_patches)), axis=1)
    ranks = jnp.argsort(order, axis=1)
    return (ranks >= occluded).astype(jnp.float32)


def every_keep_mask(num_patches: int, occluded: int) -> np.ndarray:
    """(C(N, k), N) float keep-masks: every way to occlude `occluded` of `num_patches`
    patches (120 for 2 of 16), for the worst-case occlusion accuracy."""
    masks = np.ones((math.comb(num_patches, occluded), num_patches), np.float32)
    for row, chosen in zip(masks, itertools.combinations(range(num_patches), occluded)):
        row[list(chosen)] = 0.0
    return masks


def greedy_keep(
    margin_of: Callable[[jax.Array], jax.Array], batch: int, num_patches: int, occluded: int
) -> jax.Array:
    """(occluded, batch, N) keep-masks chosen greedily against a model, one per round: in
    round r every patch not yet occluded is tried on top of the r - 1 chosen, and the one
    giving the lowest `margin_of(keep)` (B,) (the label's logit minus the best other) is
    kept; entry r - 1 occludes r patches, the last `occluded`. `occluded` * N calls of
    `margin_of`, where the exact worst case needs C(N, occluded) (58905 for 4 of 36): the
    adaptive search where there are too many masks."""
    trials = jnp.eye(num_patches, dtype=jnp.float32)

    def one_round(keep, _):
        margins = jax.lax.map(lambda patch: margin_of(keep * (1 - patch)), trials).T  # (B, N)
        margins = jnp.where(keep == 0, jnp.inf, margins)
        chosen = jax.nn.one_hot(jnp.argmin(margins, axis=1), num_patches, dtype=keep.dtype)
        keep = keep * (1 - chosen)
        return keep, keep

    keep = jnp.ones((batch, num_patches), jnp.float32)
    return jax.lax.scan(one_round, keep, None, length=occluded)[1]


def occlude_patches(
    images: jax.Array,
    keep: jax.Array,
    rng: jax.Array,
    *,
    patch_size: int,
    noise_mean,
    noise_std,
    lower,
    upper,
) -> jax.Array:
    """Eq. 1 with a given per-patch keep-mask and fresh uniform noise (training's noise
    space: (u - noise_mean) / noise_std) and clamp (None = no clamp)."""
    uniform = jax.random.uniform(rng, images.shape, images.dtype)
    noise = (uniform - jnp.asarray(noise_mean, images.dtype)) / jnp.asarray(noise_std, images.dtype)
    return rspc.occlude_with_patch_mask(images, keep, noise, patch_size, lower, upper)


def attention_cosine(clean: Sequence[jax.Array], occluded: Sequence[jax.Array]) -> jax.Array:
    """(B, layers): per layer, the head-mean cosine similarity of flattened maps
    (B, heads, ...) clean vs occluded."""
    per_layer = []
    for a, b in zip(clean, occluded, strict=True):
        a = a.reshape(a.shape[0], a.shape[1], -1).astype(jnp.float32)
        b = b.reshape(b.shape[0], b.shape[1], -1).astype(jnp.float32)
        cos = (a * b).sum(-1) / (jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(b, axis=-1) + 1e-12)
        per_layer.append(cos.mean(axis=1))
    return jnp.stack(per_layer, axis=1)


def query_attention(attention: jax.Array, query=None) -> jax.Array:
    """(B, heads, N', N') map -> (B, g, g) head-mean attention of patch `query` (default:
    the centre patch (g//2, g//2), index 105 on 14x14 as Patch-Fool) over the patch grid;
    prefix tokens (a class token) are N' - g*g, g = the largest square."""
    tokens = attention.shape[-1]
    side = int(tokens**0.5)
    prefix = tokens - side * side
    if query is None:
        query = (side // 2) * side + side // 2
    row = attention[:, :, prefix + query, prefix:].mean(axis=1)
    return row.reshape(attention.shape[0], side, side)
