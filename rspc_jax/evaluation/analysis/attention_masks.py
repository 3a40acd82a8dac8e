"""Attention restrictions of Bhojanapalli et al. Sec. 4 as allowed-pair matrices (N, N)
over a block's tokens (class-token prefix first, then the patch grid row-major), turned
into additive logit biases for `interventions.Intervention`.

Distance on the patch grid is Chebyshev (|d row| <= r and |d col| <= r: "within a certain
maximum horizontal or vertical distance"). Prefix (class) tokens attend to and are
attended by every token, as in the paper.
"""

import numpy as np

from rspc_jax.models import interventions


def grid_side(tokens: int, prefix: int) -> int:
    """The side of the square patch grid of a block with `tokens` tokens."""
    side = int(round(np.sqrt(tokens - prefix)))
    if side * side != tokens - prefix:
        raise ValueError(
            f"a block with {tokens} tokens ({prefix} before the patches) has no "
            "square patch grid; restricted attention needs square images"
        )
    return side


def _with_prefix(patch_allowed: np.ndarray, prefix: int) -> np.ndarray:
    tokens = patch_allowed.shape[0] + prefix
    allowed = np.ones((tokens, tokens), bool)
    allowed[prefix:, prefix:] = patch_allowed
    return allowed


def local(side: int, prefix: int, radius: int) -> np.ndarray:
    """Patches attend only to patches within `radius` (and to the prefix tokens)."""
    rows, cols = np.divmod(np.arange(side * side), side)
    distance = np.maximum(np.abs(rows[:, None] - rows[None]), np.abs(cols[:, None] - cols[None]))
    return _with_prefix(distance <= radius, prefix)


def random_like(allowed: np.ndarray, prefix: int, seed: int) -> np.ndarray:
    """The same number of masked patch pairs as `allowed`, placed by a permutation of the
    patch-pair entries that depends only on the grid and `seed` (fixed across radii). The
    diagonal stays allowed (every local mask allows it), so no row is left empty."""
    patch = allowed[prefix:, prefix:]
    off_diagonal = ~np.eye(patch.shape[0], dtype=bool)
    permutation = np.random.default_rng(seed).permutation(int(off_diagonal.sum()))
    shuffled = patch.copy()
    shuffled[off_diagonal] = patch[off_diagonal][permutation]
    return _with_prefix(shuffled, prefix)


def no_patch_to_patch(side: int, prefix: int) -> np.ndarray:
    """Patches attend to the class token only; without a class token, to themselves only
    (the softmax needs one allowed key)."""
    patch = np.eye(side * side, dtype=bool) if prefix == 0 else np.zeros((side * side,) * 2, bool)
    return _with_prefix(patch, prefix)


def bias(allowed: np.ndarray) -> np.ndarray:
    return np.where(allowed, 0.0, interventions.MASKED).astype(np.float32)


def masked_pairs(allowed: np.ndarray, prefix: int) -> int:
    return int((~allowed[prefix:, prefix:]).sum())
