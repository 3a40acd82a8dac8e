"""Several train steps per call (config.steps_per_call): the same steps as one per call,
within float32 rounding, run only between log, eval and checkpoint steps."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rspc_jax import ConfigError, parallel
from rspc_jax.data import specs as datasets
from rspc_jax.training import loop, reporting, setup
from tests.conftest import first_batches, on_each_train_call, smoke_config


def _assert_close(a, b, what):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-6, err_msg=what)


def test_a_call_of_three_rspc_steps_equals_three_single_steps(digits_data_dir):
    config = smoke_config(digits_data_dir, steps_per_call=3)
    spec = datasets.dataset_spec(config.dataset)
    mesh = parallel.create_mesh()
    parts = setup.build(config, setup.build_model(config, spec.num_classes), spec, mesh, 20, 20)
    batches = [parallel.to_global(b, mesh) for b in first_batches(config, 3)]
    state = parts.init(jax.random.PRNGKey(0))
    single, history = jax.tree.map(jnp.copy, state), []
    for batch in batches:
        single, metrics = parts.train_step(single, batch)
        history.append(jax.device_get(metrics))
    several, stacked = parts.train_steps(state, tuple(batches))
    stacked = jax.device_get(stacked)
    assert int(several.step) == 3
    _assert_close(jax.device_get(single), jax.device_get(several), "state after 3 steps")
    for i, metrics in enumerate(history):
        _assert_close(metrics, {k: v[i] for k, v in stacked.items()}, f"metrics of step {i}")


def _train_losses(workdir) -> dict:
    with open(workdir / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


def test_the_loop_runs_steady_stretches_together_and_trains_the_same(
    digits_data_dir, tmp_path, monkeypatch
):
    """Steps 2-4 and 6-8 of 10 (log every 5) go in calls of 3, under the transfer guard;
    the rest run alone (step 9 guarded too). States and logged losses match one step per call; a stop asked in
    the middle of a call stops at its end, with a checkpoint of that step."""
    overrides = dict(
        total_steps=10,
        log_every_steps=5,
        eval_every_steps=100,
        checkpoint_every_steps=100,
        block_each_step="no",
        transfer_guard="disallow",
    )
    single = loop.train_and_evaluate(
        smoke_config(digits_data_dir, **overrides), str(tmp_path / "single")
    )
    calls, guards = [], []
    on_each_train_call(monkeypatch, calls.append)
    guard = jax.transfer_guard

    def recording_guard(level):
        guards.append(level)
        return guard(level)

    monkeypatch.setattr(jax, "transfer_guard", recording_guard)
    config = smoke_config(digits_data_dir, steps_per_call=3, **overrides)
    together = loop.train_and_evaluate(config, str(tmp_path / "together"))
    assert calls == [1, 3, 1, 3, 1, 1], calls
    # Step 9, steady but too close to step 10 for a call of 3, is guarded too.
    assert guards == ["allow", "disallow", "allow", "disallow", "disallow", "allow"], guards
    assert together["step"] == single["step"] == 10
    _assert_close(jax.device_get(single["state"]), jax.device_get(together["state"]), "state")
    single_losses = _train_losses(tmp_path / "single")
    together_losses = _train_losses(tmp_path / "together")
    assert sorted(together_losses) == sorted(single_losses) == [5, 10]
    np.testing.assert_allclose(
        [together_losses[s] for s in (5, 10)], [single_losses[s] for s in (5, 10)], rtol=1e-5
    )

    stopped = loop.train_and_evaluate(
        config, str(tmp_path / "stopped"), should_stop=lambda step: step >= 3
    )
    assert stopped["step"] == 4
    assert sorted(p.name for p in (tmp_path / "stopped" / "checkpoints").iterdir()) == ["4"]


def test_a_non_finite_step_inside_a_call_is_named():
    ok = dict(loss=np.float32(1.0), grad_norm=np.float32(1.0), nonfinite=np.float32(0.0))
    stacked = dict(
        loss=np.array([1.0, 2.0, np.nan], np.float32),
        grad_norm=np.ones(3, np.float32),
        nonfinite=np.array([0.0, 0.0, 1.0], np.float32),
    )
    with pytest.raises(reporting.NonFiniteLossError, match="step 14 was not finite"):
        reporting.mean_and_check([ok, stacked], first_step=10)
    stacked["loss"][2], stacked["nonfinite"][2] = 3.0, 0.0
    means = reporting.mean_and_check([ok, stacked], first_step=10)
    assert means["loss"] == pytest.approx(7.0 / 4)


def test_steps_per_call_below_one_is_refused(digits_data_dir, tmp_path):
    config = smoke_config(digits_data_dir, steps_per_call=0)
    with pytest.raises(ConfigError, match=r"config.steps_per_call=0 is out of range: must be >= 1"):
        loop.train_and_evaluate(config, str(tmp_path / "run"))
