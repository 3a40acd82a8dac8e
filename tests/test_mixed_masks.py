"""Mixed masks (`rspc.mixed_keep_mask`; `rspc.learned_fraction`, `learned_fraction_ramp_epochs`,
`learned_batch_fraction`; docs/method.md, "Mixed masks"): how many patches each image loses
and how many of them C chose, the ramp, the share of the batch C masks, that the defaults and
f = 1 give C's masks exactly, where C's gradient comes from, and a train step that uses them."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rspc_jax import rspc
from tests.conftest import smoke_config

N, B = 16, 512


def _inputs(seed=0, rho=0.1):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    scores = jax.random.normal(keys[0], (B, N))
    random_scores = jax.random.uniform(keys[1], (B, N))
    draws = jax.random.uniform(keys[2], (B, 2))
    return scores, rspc.keep_mask(scores, rho), random_scores, draws


@pytest.mark.parametrize("rho", [0.1, 0.3])
@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 0.7, 1.0])
def test_each_image_loses_c_s_count_and_the_fraction_comes_from_c(rho, fraction):
    """k patches per image, as C's mask; of them fraction * k from C's mask (exactly where
    whole, else on average), and they are the ones C scores lowest."""
    scores, learned, random_scores, draws = _inputs(rho=rho)
    k = rspc.num_occluded(N, rho)
    keep, rows = rspc.mixed_keep_mask(scores, learned, random_scores, draws, fraction, 1.0)
    occluded, c_occluded = np.asarray(keep) == 0, np.asarray(learned) == 0
    assert np.asarray(rows).all()
    assert (occluded.sum(1) == k).all()
    n = np.floor(fraction * k + np.asarray(draws[:, 0]))  # C's patches per image
    if float(fraction * k).is_integer():
        assert (n == fraction * k).all()
    order = np.argsort(np.asarray(scores), axis=1)
    for image in range(B):  # C's share is its lowest-scored patches
        assert occluded[image, order[image, : int(n[image])]].all()
    # The rest are random among the other N - n patches: C's other k - n occluded patches
    # are hit only by chance.
    overlap = (occluded & c_occluded).sum(1)
    assert (overlap >= n).all()
    chance = n + (k - n) ** 2 / (N - n)
    assert overlap.mean() == pytest.approx(chance.mean(), abs=0.1)


def test_the_random_part_is_spread_over_every_position():
    scores = jnp.tile(jnp.arange(N, dtype=jnp.float32), (B, 1))  # C always wants patch 0, 1
    learned = rspc.keep_mask(scores, 0.1)
    _, _, random_scores, draws = _inputs(1)
    keep, _ = rspc.mixed_keep_mask(scores, learned, random_scores, draws, 0.5, 1.0)
    frequency = (np.asarray(keep) == 0).mean(0)
    assert frequency[0] == 1.0 and frequency[1] < 0.15
    assert (frequency[1:] > 0.02).all()  # the second patch anywhere but patch 0


@pytest.mark.parametrize("seed", [0, 1])
def test_fraction_one_and_whole_batch_return_c_s_mask_exactly(seed):
    scores, learned, random_scores, draws = _inputs(seed)
    keep, rows = rspc.mixed_keep_mask(scores, learned, random_scores, draws, 1.0, 1.0)
    np.testing.assert_array_equal(keep, learned)
    assert np.asarray(rows).all()


def test_batch_fraction_gives_c_s_masks_to_that_share_of_the_images():
    scores, learned, random_scores, draws = _inputs(2)
    keep, rows = rspc.mixed_keep_mask(scores, learned, random_scores, draws, 1.0, 0.5)
    rows = np.asarray(rows)
    assert rows.mean() == pytest.approx(0.5, abs=0.06)
    np.testing.assert_array_equal(np.asarray(keep)[rows], np.asarray(learned)[rows])
    # The other images: a random mask of the same count, i.e. C's only by chance.
    others = np.asarray(keep)[~rows]
    assert (others.sum(1) == N - 2).all()
    assert (others != np.asarray(learned)[~rows]).any(1).mean() > 0.9


def test_ramp_goes_from_zero_to_the_fraction_and_stays():
    values = [float(rspc.ramped_fraction(0.5, step, 100)) for step in (0, 25, 50, 100, 400)]
    assert values == pytest.approx([0.0, 0.125, 0.25, 0.5, 0.5])
    assert float(rspc.ramped_fraction(0.5, 7, 0)) == 0.5
    jitted = jax.jit(lambda s: rspc.ramped_fraction(0.5, s, 100))
    assert float(jitted(jnp.asarray(50))) == pytest.approx(0.25)


def test_defaults_leave_the_masks_c_s_and_switches_turn_mixing_on():
    config = smoke_config("")
    assert not rspc.mixed_masks(config.rspc)  # the official default
    for field, value in [
        ("learned_fraction", 0.5),
        ("learned_fraction_ramp_epochs", 3.0),
        ("learned_batch_fraction", 0.5),
    ]:
        switched = smoke_config("")
        switched.rspc[field] = value
        assert rspc.mixed_masks(switched.rspc), field
        switched.rspc.selection = "random"  # random masks have nothing to mix
        assert not rspc.mixed_masks(switched.rspc), field


class _GivenScores:
    """A stand-in for C whose parameters are its scores (B, N), so that the gradient with
    respect to them is the one reaching C's scores."""

    patch_size = 4

    def apply(self, variables, images):
        return variables["params"]


def _c_gradient(mixing, sampling=None):
    """The gradient reaching C's scores through `corrupt_batch`, per image, of a loss whose
    gradient with respect to the mask is known."""
    images = jax.random.uniform(jax.random.PRNGKey(3), (8, 16, 16, 3))

    def loss(scores):
        _, mask = rspc.corrupt_batch(
            scores,
            images,
            jnp.zeros_like(images),
            corruption_model=_GivenScores(),
            rho=0.1,
            ste_clip=1.0,
            grad_scale=1.0,
            lower=None,
            upper=None,
            sampling=sampling,
            mixing=mixing,
        )
        return jnp.sum(mask * jnp.arange(1.0, N + 1) * 0.01)

    scores = jax.random.normal(jax.random.PRNGKey(4), (8, N))
    return np.asarray(jax.grad(loss)(scores))


def test_c_s_gradient_comes_from_the_images_c_masks_and_nowhere_else():
    """The STE passes the gradient to C's scores for the images of C's share of the batch
    (also while the ramp keeps its share of their patches at 0), and none for the others."""
    draws = jnp.stack([jnp.zeros(8), jnp.array([0.1, 0.9] * 4)], axis=1)
    random_scores = jax.random.uniform(jax.random.PRNGKey(5), (8, N))
    expected = np.tile(np.arange(1.0, N + 1) * 0.01, (8, 1))
    official = _c_gradient(None)
    np.testing.assert_allclose(official, expected, rtol=1e-6)
    for fraction in (0.0, 0.5, 1.0):
        grad = _c_gradient((random_scores, draws, fraction, 0.5))
        np.testing.assert_allclose(grad[0::2], expected[0::2], rtol=1e-6)
        assert (grad[1::2] == 0).all()
    gumbel = jax.random.gumbel(jax.random.PRNGKey(6), (8, N))
    sampled = _c_gradient((random_scores, draws, 0.5, 0.5), sampling=(gumbel, 1.0))
    np.testing.assert_allclose(sampled[0::2], expected[0::2], rtol=1e-6)
    assert (sampled[1::2] == 0).all()


def test_train_step_with_mixed_masks(digits_data_dir, tmp_path):
    """A short run with the content C, half of each mask and half of the batch from C: the
    step occludes k of N patches per image, C still trains, and the masks spread over more
    positions than C's own."""
    from rspc_jax.training import loop

    config = smoke_config(digits_data_dir)
    config.dataset = "sklearn_digits_textured"
    config.rspc.update(
        corruption_model="content", lam=0.5, learned_fraction=0.5, learned_batch_fraction=0.5
    )
    config.rspc.learned_fraction_ramp_epochs = 0.5
    workdir = str(tmp_path / "run")
    loop.train_and_evaluate(config, workdir)
    rows = [json.loads(line) for line in open(f"{workdir}/metrics.jsonl")]
    logged = [r for r in rows if "train/selection_distinct_masks" in r]
    assert logged and all(r["train/occluded_fraction"] == pytest.approx(2 / N) for r in logged)
    assert all(r["train/corruption_grad_norm"] > 0 for r in logged)
    assert all(r["train/selection_entropy"] > 0.8 for r in logged)
