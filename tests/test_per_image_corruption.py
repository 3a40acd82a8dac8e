"""The per-image corruption model beside the official one (`rspc.corruption_model='content'`,
`rspc.temperature`; docs/method.md, "A per-image C"): what its scores can depend on, how its
masks are drawn, that its gradient is the official estimator's, that the train step and the
report use it, and that the official default is untouched."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rspc_jax import rspc
from tests.conftest import smoke_config

N, K = 16, 2  # 4 x 4 patches, rho 0.1


def _images(seed=0, count=4, size=16):
    return jax.random.normal(jax.random.PRNGKey(seed), (count, size, size, 3))


def test_content_model_scores_a_patch_by_its_pixels_wherever_it_is():
    """Moving the patches moves their scores with them: the score has no position term."""
    model = rspc.ContentCorruptionModel(patch_size=4)
    images = _images()
    params = model.init(jax.random.PRNGKey(1), images)["params"]
    scores = model.apply({"params": params}, images)
    # Permute the 4 x 4 grid of 4-px patches.
    order = np.random.default_rng(0).permutation(N)
    patches = images.reshape(4, 4, 4, 4, 4, 3).transpose(0, 1, 3, 2, 4, 5).reshape(4, N, 4, 4, 3)
    moved = patches[:, order].reshape(4, 4, 4, 4, 4, 3).transpose(0, 1, 3, 2, 4, 5)
    moved_scores = model.apply({"params": params}, moved.reshape(images.shape))
    np.testing.assert_allclose(moved_scores, scores[:, order], rtol=1e-5, atol=1e-6)


def test_official_model_scores_depend_on_position():
    """The contrast: the official C's Dense layer gives a moved patch another score."""
    model = rspc.PatchCorruptionModel(patch_size=4)
    images = jnp.zeros((1, 16, 16, 3)).at[:, :4, :4].set(1.0)
    moved = jnp.zeros((1, 16, 16, 3)).at[:, 12:, 12:].set(1.0)
    params = model.init(jax.random.PRNGKey(1), images)["params"]
    scores, moved_scores = (model.apply({"params": params}, x) for x in (images, moved))
    assert abs(float(scores[0, 0] - moved_scores[0, 15])) > 1e-3


@pytest.mark.parametrize("rho", [0.05, 0.1, 0.3])
def test_sampled_masks_occlude_the_official_count_and_at_zero_temperature_the_lowest(rho):
    scores = jax.random.normal(jax.random.PRNGKey(0), (8, N)) * 40.0 + 7.0
    gumbel = jax.random.gumbel(jax.random.PRNGKey(1), scores.shape)
    k = rspc.num_occluded(N, rho)
    for temperature in (0.0, 0.5, 4.0):
        keep = np.asarray(rspc.sampled_keep_mask(scores, rho, gumbel, temperature))
        np.testing.assert_array_equal((keep == 0).sum(axis=1), k)
    lowest = np.argsort(np.asarray(scores), axis=1)[:, :k]
    keep = np.asarray(rspc.sampled_keep_mask(scores, rho, gumbel, 0.0))
    assert np.all(np.take_along_axis(keep, lowest, 1) == 0)
    # Distinct scores: the official rule chooses the same patches.
    np.testing.assert_array_equal(keep, rspc.keep_mask(scores, rho))


def test_ties_are_broken_by_the_draws_not_by_position():
    """Scores that all tie (a blank image under the content C): exactly k occluded per image,
    and the chosen positions spread over the grid instead of always the first ones."""
    scores = jnp.zeros((512, N))
    gumbel = jax.random.gumbel(jax.random.PRNGKey(0), scores.shape)
    occluded = 1 - np.asarray(rspc.sampled_keep_mask(scores, 0.1, gumbel, 0.0))
    np.testing.assert_array_equal(occluded.sum(axis=1), K)
    frequency = occluded.mean(axis=0)
    np.testing.assert_allclose(frequency, K / N, atol=0.05)


def test_temperature_moves_the_masks_from_the_lowest_scores_towards_uniform():
    """Gumbel top-k samples without replacement from softmax(-z / temperature): at a high
    temperature every position is drawn about equally often, at a low one the lowest."""
    scores = jnp.tile(jnp.arange(N, dtype=jnp.float32), (4096, 1))  # position 0, 1 lowest
    gumbel = jax.random.gumbel(jax.random.PRNGKey(0), scores.shape)

    def frequency(temperature):
        keep = rspc.sampled_keep_mask(scores, 0.1, gumbel, temperature)
        return np.asarray(1 - keep).mean(axis=0)

    np.testing.assert_allclose(frequency(0.0)[:2], 1.0)
    hot = frequency(100.0)
    np.testing.assert_allclose(hot, K / N, atol=0.03)
    warm = frequency(1.0)
    assert hot[0] < warm[0] < 1.0 and warm[-1] < hot[-1]


def test_sampled_masks_pass_the_official_straight_through_gradient():
    scores = jax.random.normal(jax.random.PRNGKey(0), (3, N))
    gumbel = jax.random.gumbel(jax.random.PRNGKey(1), scores.shape)
    g = 2.0 * jax.random.normal(jax.random.PRNGKey(2), (3, N))

    def sampled(s):
        hard = rspc.sampled_keep_mask(jax.lax.stop_gradient(s), 0.1, gumbel, 1.0)
        return rspc.straight_through(s, hard, 1.0, 65536.0)

    for fn in (sampled, lambda s: rspc.binarize(s, 0.1, 1.0, 65536.0)):
        _, vjp = jax.vjp(fn, scores)
        np.testing.assert_allclose(vjp(g)[0], np.clip(g * 65536.0, -1, 1))


def test_only_the_switches_select_the_sampled_rule():
    config = smoke_config("")
    assert rspc.selection_temperature(config.rspc) is None  # the official default
    config.rspc.corruption_model = "content"
    assert rspc.selection_temperature(config.rspc) == 0.0
    config.rspc.corruption_model, config.rspc.temperature = "official", 1.0
    assert rspc.selection_temperature(config.rspc) == 1.0
    config.rspc.selection = "random"
    assert rspc.selection_temperature(config.rspc) is None


@pytest.mark.parametrize(
    "field,value,words",
    [("rspc.corruption_model", "contents", "official"), ("rspc.temperature", -1.0, ">= 0")],
)
def test_bad_switches_are_refused_before_anything_compiles(field, value, words):
    from rspc_jax import ConfigError
    from rspc_jax.training import checks

    config = smoke_config("")
    section, name = field.split(".")
    config[section][name] = value
    with pytest.raises(ConfigError, match=words):
        checks.validate_config(config)


def test_train_step_trains_the_content_model_with_per_image_masks(digits_data_dir, tmp_path):
    """A short run with the content C on the textured digits: C's parameters move, every
    image of each logged batch has its own draw of k patches, and the report's C masks use
    the content C (the official C's parameters would not even load into it)."""
    from rspc_jax.evaluation import run_suites
    from rspc_jax.interop import checkpoints
    from rspc_jax.training import loop

    config = smoke_config(digits_data_dir)
    config.dataset = "sklearn_digits_textured"
    config.rspc.corruption_model = "content"
    config.rspc.temperature = 1.0
    config.rspc.lam = 0.5
    config.evaluation.suites = "patch_occlusion"
    config.evaluation.occlusion_masks = 2
    config.evaluation.num_examples = 64
    workdir = str(tmp_path / "run")
    loop.train_and_evaluate(config, workdir)
    rows = [json.loads(line) for line in open(f"{workdir}/metrics.jsonl")]
    logged = [r for r in rows if "train/selection_distinct_masks" in r]
    assert logged and all(r["train/occluded_fraction"] == pytest.approx(K / N) for r in logged)
    assert all(r["train/selection_distinct_masks"] > 20 for r in logged)
    assert all(r["train/selection_modal_mask_share"] < 0.2 for r in logged)
    assert all(0 <= r["train/selection_on_object"] <= 1 for r in logged)
    assert all(r["train/corruption_grad_norm"] > 0 for r in logged)
    _, state, _ = checkpoints.read_saved_state(f"{workdir}/checkpoints")
    assert set(state["corruption_params"]) == {"patch_embed", "score"}
    results = run_suites.run_suites(config, workdir=workdir, out=str(tmp_path / "eval"))
    chosen = results["patch_occlusion"]["selection"]
    assert chosen["distinct_masks"] >= 2 and 0 < chosen["modal_mask_share"] < 1
    assert "blank_mask_iou" not in chosen  # the textured digits have no blank image
    assert 0 <= chosen["on_object"] <= 1
    every = results["patch_occlusion"]["every_mask_accuracy"]
    assert every["masks"] == 120 and 0 <= every["worst_case"] <= every["mean"] <= 1
