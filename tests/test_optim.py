"""The classifier's learning-rate schedule: DeiT scaling, warm-up, cosine, cool-down."""

import ml_collections
import numpy as np

from rspc_jax.training import optim


def _config(**overrides):
    return ml_collections.ConfigDict(
        dict(dict(lr=5e-4, lr_base_batch=512, warmup_lr=1e-6, min_lr=1e-5), **overrides)
    )


def test_warmup_cosine_then_cooldown_at_min_lr():
    schedule = optim.learning_rate(
        _config(), batch_size=2048, warmup_steps=10, total_steps=110, cooldown_steps=10
    )
    peak = 5e-4 * 2048 / 512
    np.testing.assert_allclose(schedule(0), 1e-6, rtol=1e-5)
    np.testing.assert_allclose(schedule(10), peak, rtol=1e-5)
    # Cosine from the peak at step 10 to min_lr at step 100 (total - cooldown).
    np.testing.assert_allclose(schedule(55), 1e-5 + (peak - 1e-5) * 0.5, rtol=1e-5)
    for step in (100, 105, 109):
        np.testing.assert_allclose(schedule(step), 1e-5, rtol=1e-5)


def test_without_cooldown_the_cosine_spans_every_step():
    schedule = optim.learning_rate(
        _config(lr_base_batch=128), batch_size=128, warmup_steps=0, total_steps=100
    )
    np.testing.assert_allclose(schedule(0), 5e-4, rtol=1e-5)
    np.testing.assert_allclose(schedule(50), 1e-5 + (5e-4 - 1e-5) * 0.5, rtol=1e-5)
    assert schedule(99) > 1e-5
