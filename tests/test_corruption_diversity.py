"""The diversity term on C's scores (`rspc.corruption_diversity`; docs/method.md, "A diversity
term on C's scores"): it measures how alike C's score patterns are over the batch, ascending
it spreads C's choices, and in the train step it moves C only, never the classifier; off by
default."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rspc_jax import parallel, rspc
from rspc_jax.data import specs as datasets
from rspc_jax.training import checks, defaults, setup
from tests.conftest import first_batches, smoke_config


def test_similarity_is_one_for_a_collapsed_c_and_about_one_over_b_for_independent_images():
    rng = np.random.default_rng(0)
    pattern = rng.normal(size=16)
    # The same pattern at any per-image scale and offset is the same choice of patches.
    collapsed = pattern * rng.uniform(0.5, 3, (64, 1)) + rng.normal(size=(64, 1))
    assert float(rspc.score_similarity(jnp.asarray(collapsed))) == pytest.approx(1.0, abs=1e-5)
    independent = rng.normal(size=(256, 16))
    assert float(rspc.score_similarity(jnp.asarray(independent))) == pytest.approx(1 / 256, rel=0.3)


def test_ascending_the_term_spreads_a_collapsed_c_and_its_gradient_is_of_order_weight():
    rng = np.random.default_rng(1)
    scores = jnp.asarray(rng.normal(size=16) + 0.1 * rng.normal(size=(32, 16)))
    grad = jax.grad(rspc.diversity_loss)(scores, 1.0)
    # The gradient on each standardised score is the patch's batch mean: order 1, not B or N.
    assert 0.1 < float(jnp.abs(grad).max()) < 10
    before = float(rspc.score_similarity(scores))
    for _ in range(20):  # C ascends the loss it is given
        scores = scores + 0.05 * jax.grad(rspc.diversity_loss)(scores, 1.0)
    assert float(rspc.score_similarity(scores)) < before - 0.2


def _one_step(config, batch, initial):
    spec = datasets.dataset_spec(config.dataset)
    model = setup.build_model(config, spec.num_classes)
    parts = setup.build(
        config, model, spec, parallel.create_mesh(), steps_per_epoch=10, total_steps=10
    )
    state, metrics = parts.train_step(jax.tree.map(jnp.copy, initial), batch)
    return jax.device_get(state), jax.device_get(metrics)


def test_the_term_moves_c_and_leaves_the_classifier_and_the_loss_alone(digits_data_dir):
    """One step from the same state on the same batch with and without the term: the
    classifier's update, the loss and CE are the same; C's update is not; the step logs
    the batch's score similarity only with the term on."""
    config = smoke_config(digits_data_dir, **{"model.drop_path_rate": 0.0})
    config.rspc.lam = 0.5
    batch = parallel.to_global(first_batches(config)[0], parallel.create_mesh())
    spec = datasets.dataset_spec(config.dataset)
    model = setup.build_model(config, spec.num_classes)
    parts = setup.build(
        config, model, spec, parallel.create_mesh(), steps_per_epoch=10, total_steps=10
    )
    initial = jax.device_get(parts.init(jax.random.PRNGKey(0)))
    official, official_metrics = _one_step(config, batch, initial)
    config.rspc.corruption_diversity = 1.0
    diverse, diverse_metrics = _one_step(config, batch, initial)
    for a, b in zip(jax.tree.leaves(official.params), jax.tree.leaves(diverse.params)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    for name in ("loss", "ce", "align"):
        assert diverse_metrics[name] == pytest.approx(official_metrics[name], rel=1e-6)
    moved = [
        float(np.abs(a - b).max())
        for a, b in zip(
            jax.tree.leaves(official.corruption_params), jax.tree.leaves(diverse.corruption_params)
        )
    ]
    assert max(moved) > 1e-6
    assert "score_similarity" not in official_metrics
    assert 0 < diverse_metrics["score_similarity"] <= 1


def test_a_negative_weight_is_refused_before_anything_compiles():
    config = defaults.get_default_config()
    config.rspc.corruption_diversity = -0.5
    with pytest.raises(checks.ConfigError, match="rspc.corruption_diversity"):
        checks.validate_config(config)
