"""Mixup / CutMix on device: the mixing lambda's distribution, the mixing itself, and a step
free of device loops (whose predicates a GPU copies to the host on every iteration)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from rspc_jax import parallel
from rspc_jax.data import specs as datasets
from rspc_jax.models import ops
from rspc_jax.training import mixup, setup
from tests.conftest import first_batches, smoke_config

_MIX = dict(num_classes=10, switch_prob=0.5, prob=1.0, smoothing=0.1)


@pytest.mark.parametrize("alpha", [0.2, 0.8, 1.0, 2.5])
def test_log_gamma_draws_follow_the_gamma_distribution(alpha):
    keys = jax.random.split(jax.random.PRNGKey(3), 20000)
    draws = np.asarray(jax.jit(jax.vmap(lambda k: mixup._log_gamma(k, alpha)))(keys), np.float64)
    # Kolmogorov-Smirnov against scipy's Gamma(alpha) (of the log: P(log G <= t) = F(e^t));
    # the boost for alpha < 1 left out, or Gamma(alpha + 1) drawn instead, gives p < 1e-10.
    assert stats.kstest(draws, lambda t: stats.gamma(alpha).cdf(np.exp(t))).pvalue > 1e-3


@pytest.mark.parametrize("alpha", [0.2, 0.8, 1.0, 2.5])
def test_symmetric_beta_draws_follow_the_beta_distribution(alpha):
    keys = jax.random.split(jax.random.PRNGKey(4), 20000)
    draws = np.asarray(jax.jit(jax.vmap(lambda k: mixup.symmetric_beta(k, alpha)))(keys))
    assert np.all((draws >= 0) & (draws <= 1))
    var = 1 / (4 * (2 * alpha + 1))
    assert abs(draws.mean() - 0.5) < 4 * np.sqrt(var / draws.size)
    assert abs(draws.var() / var - 1) < 0.05
    if alpha >= 0.8:  # below, float32 rounds a few percent of the draws to exactly 1.0
        assert stats.kstest(draws, stats.beta(alpha, alpha).cdf).pvalue > 1e-3


def test_symmetric_beta_of_a_tiny_alpha_is_zero_or_one_and_finite():
    keys = jax.random.split(jax.random.PRNGKey(0), 2000)
    draws = np.asarray(jax.vmap(lambda k: mixup.symmetric_beta(k, 1e-3))(keys))
    assert np.all(np.isfinite(draws))
    # Beta(1e-3, 1e-3) puts 49.3% of its mass below 1e-6 and as much above 1 - 1e-6.
    assert np.mean((draws < 1e-6) | (draws > 1 - 1e-6)) > 0.97
    assert 0.45 < np.mean(draws > 0.5) < 0.55


def test_the_mixing_has_no_device_loop():
    """jax.random.beta draws its gammas by rejection in while loops; on a GPU each iteration
    copies the loop's predicate to the host, which stalls every train step."""
    images = jnp.zeros((4, 8, 8, 3))
    labels = jnp.arange(4)
    mix = functools.partial(mixup.mixup_cutmix, mixup_alpha=0.8, cutmix_alpha=1.0, **_MIX)
    jaxpr = jax.make_jaxpr(mix)(jax.random.PRNGKey(0), images, labels)
    primitives = _primitives(jaxpr.jaxpr)
    assert "threefry2x32" in primitives or "random_bits" in primitives  # the walk sees inside
    assert not primitives & {"while", "random_gamma", "cond"}, primitives


def test_the_rspc_train_step_with_mixing_has_no_loop_on_gpu_or_tpu(digits_data_dir):
    """Lowered (not compiled) for each accelerator, with the window ops an accelerator
    traces: no while loop anywhere in the step. (On the CPU, JAX's threefry hash is a loop
    of five rounds, and large depthwise kernel gradients loop over image chunks.)"""
    config = smoke_config(digits_data_dir, **{"mixup.mixup_alpha": 0.8, "mixup.cutmix_alpha": 1.0})
    assert config.rspc.enabled
    spec = datasets.dataset_spec(config.dataset)
    mesh = parallel.create_mesh()
    parts = setup.build(config, setup.build_model(config, spec.num_classes), spec, mesh, 20, 20)
    state = jax.eval_shape(parts.init, jax.random.PRNGKey(0))
    with ops.implementations(window_ops="xla"):
        traced = parts.train_step.trace(state, parallel.to_global(first_batches(config)[0], mesh))
    for platform in ("cuda", "tpu"):
        program = traced.lower(lowering_platforms=(platform,)).as_text(debug_info=True)
        assert "mixup.py" in program  # the mixing is in the step
        assert program.count("stablehlo.while") == 0, platform


def _primitives(jaxpr) -> set[str]:
    """Every primitive in `jaxpr` and the jaxprs nested in its equations (jit, custom_jvp)."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for param in eqn.params.values():
            for value in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(value, "jaxpr", value)
                if hasattr(inner, "eqns"):
                    names |= _primitives(inner)
    return names


def _mix(seed, images, labels, **alphas):
    return mixup.mixup_cutmix(jax.random.PRNGKey(seed), images, labels, **alphas, **_MIX)


def test_mixup_alone_blends_each_image_with_the_flipped_batch_by_one_lambda():
    rng = np.random.default_rng(0)
    images = jnp.asarray(rng.uniform(size=(4, 6, 6, 3)), jnp.float32)
    labels = jnp.array([0, 1, 2, 3])
    mixed, targets = _mix(1, images, labels, mixup_alpha=0.8, cutmix_alpha=0.0)
    # image 0 = lam * image0 + (1 - lam) * image3: solve for lam from one pixel pair
    lam = float((mixed[0] - images[3])[0, 0, 0] / (images[0] - images[3])[0, 0, 0])
    np.testing.assert_allclose(mixed, lam * images + (1 - lam) * images[::-1], atol=1e-5)
    smooth = mixup.one_hot_smoothed(labels, 10, 0.1)
    np.testing.assert_allclose(targets, lam * smooth + (1 - lam) * smooth[::-1], atol=1e-5)
    np.testing.assert_allclose(targets.sum(-1), 1.0, atol=1e-5)


def test_cutmix_alone_pastes_one_box_and_weights_targets_by_its_area():
    images = jnp.broadcast_to(jnp.arange(4.0)[:, None, None, None], (4, 16, 16, 3))
    labels = jnp.array([0, 1, 2, 3])
    for seed in range(5):
        mixed, targets = _mix(seed, images, labels, mixup_alpha=0.0, cutmix_alpha=1.0)
        pasted = np.asarray(mixed[0, :, :, 0] == 3.0)  # image 0 takes image 3's pixels
        rows, cols = np.nonzero(pasted)
        if rows.size:  # one axis-aligned box
            assert pasted[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1].all()
        assert np.all((mixed[0] == 0.0) | (mixed[0] == 3.0))
        lam = 1.0 - pasted.mean()
        smooth = mixup.one_hot_smoothed(labels, 10, 0.1)
        np.testing.assert_allclose(targets[0], lam * smooth[0] + (1 - lam) * smooth[3], atol=1e-6)
