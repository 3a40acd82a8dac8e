"""The classifier's learning-rate schedule: DeiT scaling, warm-up, cosine, cool-down, and
the official per-epoch stepping."""

import json

import ml_collections
import numpy as np
import pytest

from rspc_jax import ConfigError
from rspc_jax.training import checks, defaults, optim
from tests.conftest import run_python, skip_without


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


def _official(**overrides):
    return _config(schedule="official_epochs", warmup_epochs=3.0, cooldown_epochs=2.0, **overrides)


def test_official_schedule_closed_form_per_epoch_with_the_loops_lag():
    steps_per_epoch, epochs, batch = 4, 12, 256
    schedule = optim.schedule_for_run(
        _official(), batch_size=batch, steps_per_epoch=steps_per_epoch, total_steps=12 * 4
    )
    peak, cosine_epochs = 5e-4 * batch / 512, epochs - 2

    def timm_value(t):  # CosineLRScheduler._get_lr, warmup_prefix off
        if t < 3:
            return 1e-6 + t * (peak - 1e-6) / 3
        if t < cosine_epochs:
            return 1e-5 + 0.5 * (peak - 1e-5) * (1 + np.cos(np.pi * t / cosine_epochs))
        return 1e-5

    for step in range(epochs * steps_per_epoch):
        epoch = step // steps_per_epoch
        np.testing.assert_allclose(schedule(step), timm_value(max(epoch - 1, 0)), rtol=1e-5)
    # Epochs 0 and 1 both train at the warm-up's first value; the lr is constant in an epoch.
    assert float(schedule(0)) == float(schedule(7)) == np.float32(1e-6)
    assert float(schedule(8)) > float(schedule(7))


# timm's learning rate of each epoch with its scheduler driven as RSPC_RVT/main.py drives it
# (the value set at construction, then `scheduler.step(epoch)` after each epoch). Run in a fresh
# process: timm imports torchvision, whose triton import crashes in a process that has already
# loaded JAX and TensorFlow.
_TIMM_EPOCH_LRS = """
import argparse, json, sys
import torch
from timm import scheduler as scheduler_factory

epochs, warmup, cooldown, peak = (float(a) for a in sys.argv[1:])
optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=peak)
args = argparse.Namespace(
    sched="cosine", epochs=int(epochs - cooldown), min_lr=1e-5, warmup_lr=1e-6,
    warmup_epochs=int(warmup), cooldown_epochs=int(cooldown), decay_epochs=30,
    decay_rate=0.1, lr_noise=None,
)
scheduler, total_epochs = scheduler_factory.create_scheduler(args, optimizer)
lrs = []
for epoch in range(total_epochs):
    lrs.append(optimizer.param_groups[0]["lr"])
    scheduler.step(epoch)
print(json.dumps(lrs))
"""


def test_official_schedule_matches_timm_stepped_as_rvts_main_steps_it():
    skip_without("timm")
    epochs, warmup, cooldown, steps_per_epoch, batch = 20, 5, 3, 3, 128
    peak = 5e-4 * batch / 512
    result = run_python(["-c", _TIMM_EPOCH_LRS, *map(str, (epochs, warmup, cooldown, peak))])
    assert result.returncode == 0, result.stderr[-2000:]
    timm_lrs = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(timm_lrs) == epochs  # timm returns --epochs plus the cool-down
    ours = optim.schedule_for_run(
        _config(schedule="official_epochs", warmup_epochs=warmup, cooldown_epochs=cooldown),
        batch_size=batch,
        steps_per_epoch=steps_per_epoch,
        total_steps=epochs * steps_per_epoch,
    )
    for epoch, lr in enumerate(timm_lrs):
        for step in range(epoch * steps_per_epoch, (epoch + 1) * steps_per_epoch):
            np.testing.assert_allclose(ours(step), lr, rtol=1e-5)


def test_the_schedule_switch_is_validated():
    config = defaults.get_default_config()
    config.optimizer.schedule = "per_epoch"
    with pytest.raises(ConfigError, match="optimizer.schedule"):
        checks.validate_config(config)
    config.optimizer.schedule = "official_epochs"
    checks.validate_config(config)
