"""The greedy adaptive occlusion search (evaluation/occlusion.py `greedy_keep`): exact where
the margin is additive over patches, greedy (not exhaustive) where patches interact. The
suite on a trained model is checked against the exact worst case in tests/test_evaluate.py."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rspc_jax.evaluation import occlusion


@pytest.mark.parametrize("occluded", [1, 2, 4])
def test_an_additive_margin_gets_the_exact_worst_mask(occluded):
    """margin = 1 - the summed weights of the occluded patches: the worst mask occludes the
    k heaviest patches of each image, which greedy finds round by round."""
    weights = jax.random.uniform(jax.random.PRNGKey(occluded), (5, 36))

    def margin_of(keep):
        return 1.0 - ((1 - keep) * weights).sum(axis=1)

    rounds = jax.jit(lambda: occlusion.greedy_keep(margin_of, 5, 36, occluded))()
    assert rounds.shape == (occluded, 5, 36)
    order = np.argsort(-np.asarray(weights), axis=1)
    for r, keep in enumerate(np.asarray(rounds), start=1):  # round r: the r heaviest
        expected = np.ones((5, 36), np.float32)
        np.put_along_axis(expected, order[:, :r], 0.0, axis=1)
        np.testing.assert_array_equal(keep, expected)


def test_interacting_patches_show_the_search_is_greedy_not_exhaustive():
    """Patch 0 alone hurts most, but patches 1 and 2 together hurt far more: greedy takes 0
    first and then the best partner for it; the exhaustive search takes {1, 2}."""
    pair_margin = {
        (0, 1): -1.5,
        (0, 2): -1.2,
        (1, 2): -10.0,
        (0, 3): -1.1,
        (1, 3): 0.5,
        (2, 3): 0.4,
    }

    def margin_of(keep):
        occluded = 1 - keep[0]
        single = jnp.array([-1.0, -0.5, -0.4, 0.0]) @ occluded
        pairs = sum(v * occluded[a] * occluded[b] for (a, b), v in pair_margin.items())
        return jnp.where(occluded.sum() == 2, pairs, 1.0 + single)[None]

    first, second = np.asarray(occlusion.greedy_keep(margin_of, 1, 4, 2))[:, 0]
    assert set(np.flatnonzero(first == 0)) == {0}
    assert set(np.flatnonzero(second == 0)) == {0, 1}
    exhaustive = min(itertools.combinations(range(4), 2), key=pair_margin.get)
    assert exhaustive == (1, 2)


def test_each_mask_occludes_exactly_k_distinct_patches():
    """A constant margin (every trial ties): still r distinct patches per image in round r."""
    rounds = occlusion.greedy_keep(lambda keep: jnp.zeros(keep.shape[0]), 3, 16, 3)
    assert np.asarray(rounds).sum(axis=2).tolist() == [[15] * 3, [14] * 3, [13] * 3]
