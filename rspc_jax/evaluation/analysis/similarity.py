"""Representation similarity between blocks: per-example Pearson correlation (our reading
of Bhojanapalli et al.'s Fig. 7, whose statistic the paper does not define) and linear
CKA (Kornblith et al. 2019) as a labelled extra, estimated over minibatches with the
unbiased HSIC (Song et al. 2012; Nguyen et al. 2021), so no Gram matrix over the whole
dataset is ever held.

Features are (batch, features) float arrays, one per block; `mask` (batch,) marks the
real examples of a padded batch.
"""

import jax.numpy as jnp
import numpy as np

_TINY = 1e-12


def pearson_sums(features: list, mask) -> jnp.ndarray:
    """(L, L) sums over real examples of corr(features_i[b], features_j[b]); NaN where the
    two blocks' features differ in size (stages of different widths)."""
    standardised = []
    for x in features:
        x = x.astype(jnp.float32)
        x = x - x.mean(axis=1, keepdims=True)
        standardised.append(x / jnp.sqrt(jnp.maximum((x * x).sum(axis=1, keepdims=True), _TINY)))
    rows = []
    for a in standardised:
        rows.append(
            jnp.stack(
                [
                    ((a * b).sum(axis=1) * mask).sum()
                    if a.shape == b.shape
                    else jnp.float32(jnp.nan)
                    for b in standardised
                ]
            )
        )
    return jnp.stack(rows)


def hsic_sums(features: list, mask) -> jnp.ndarray:
    """(L, L) unbiased HSIC of the blocks' linear Gram matrices over this minibatch's real
    examples (0 when fewer than 4, the estimator's minimum)."""
    n = mask.sum()
    grams = []
    for x in features:
        x = x.astype(jnp.float32) * mask[:, None]
        gram = x @ x.T
        grams.append(gram * (1.0 - jnp.eye(gram.shape[0], dtype=gram.dtype)))  # K~: zero diagonal
    grams = jnp.stack(grams)  # (L, B, B)
    trace_products = jnp.einsum("iab,jab->ij", grams, grams)
    row_sums = grams.sum(axis=2)  # (L, B)
    totals = row_sums.sum(axis=1)  # (L,)
    safe_n = jnp.maximum(n, 4.0)
    hsic = (
        trace_products
        + jnp.outer(totals, totals) / ((safe_n - 1) * (safe_n - 2))
        - 2.0 / (safe_n - 2) * row_sums @ row_sums.T
    ) / (safe_n * (safe_n - 3))
    return jnp.where(n >= 4, hsic, 0.0)


def cka_from_hsic(hsic: np.ndarray) -> np.ndarray:
    """Minibatch CKA: sum_b HSIC(K_i, K_j) / sqrt(sum_b HSIC(K_i, K_i) sum_b HSIC(K_j, K_j))."""
    diagonal = np.sqrt(np.maximum(np.diag(hsic), _TINY))
    return hsic / np.outer(diagonal, diagonal)
