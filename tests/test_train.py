"""The train step and loop: ascent/descent signs, resume, errors, the demo end to end."""

import collections
import contextlib
import functools
import logging
import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rspc_jax import parallel, rspc
from rspc_jax.data import on_device
from rspc_jax.data import specs as datasets
from rspc_jax.models import ops
from rspc_jax.training import host_memory, mixup, setup
from rspc_jax.training import loop as train
from rspc_jax.training import step as train_step_lib
from tests.conftest import REPO, first_batches, on_each_train_call, run_python, smoke_config


def _loss_at(
    config, parts_model, state, batch, params, corruption_params, corruption_model, rho=0.1
):
    """RSPC loss parts on `batch` with the step's own noise, without dropout."""
    noise_rng = train_step_lib.step_keys(state)[0]
    spec = datasets.dataset_spec(config.dataset)
    images = on_device.prepared(batch, spec.mean, spec.std)  # as the step takes them
    noise = rspc.uniform_noise(noise_rng, jnp.arange(images.shape[0]), images.shape[1:])
    lower, upper = rspc.normalized_limits(rspc.IMAGENET_MEAN, rspc.IMAGENET_STD)
    targets = mixup.one_hot_smoothed(batch["label"], 10, config.label_smoothing)
    return rspc.rspc_loss(
        params,
        corruption_params,
        state.batch_stats,
        images,
        targets,
        noise,
        model=parts_model,
        corruption_model=corruption_model,
        rho=rho,
        lam=config.rspc.lam,
        ste_clip=1.0,
        grad_scale=config.rspc.corruption_grad_scale,
        lower=lower,
        upper=upper,
        rngs={},
    )


def test_one_step_descends_the_classifier_and_ascends_the_corruption_model(digits_data_dir):
    config = smoke_config(
        digits_data_dir,
        **{
            "optimizer.warmup_epochs": 0.0,
            "rspc.optimizer.weight_decay": 0.0,
            "rspc.optimizer.lr": 0.05,
            "model.drop_path_rate": 0.0,
        },
    )
    spec = datasets.dataset_spec(config.dataset)
    model = setup.build_model(config, spec.num_classes)
    mesh = parallel.create_mesh()
    parts = setup.build(config, model, spec, mesh, steps_per_epoch=20, total_steps=20)
    state = parts.init(jax.random.PRNGKey(0))
    batch = first_batches(config)[0]
    corruption_model = rspc.PatchCorruptionModel(model.patch_size)
    loss_at = functools.partial(
        _loss_at, config, model, state, batch, corruption_model=corruption_model
    )

    before_total, before = loss_at(state.params, state.corruption_params)
    corruption_grad = jax.grad(lambda p: loss_at(state.params, p)[0])(state.corruption_params)
    new_state, metrics = parts.train_step(
        jax.tree.map(jnp.copy, state), parallel.to_global(batch, mesh)
    )

    # The corruption model moves along its (STE) gradient: first-order change > 0 ...
    delta = jax.tree.map(jnp.subtract, new_state.corruption_params, state.corruption_params)
    inner = sum(
        jnp.vdot(d, g) for d, g in zip(jax.tree.leaves(delta), jax.tree.leaves(corruption_grad))
    )
    assert inner > 0
    # ... and the alignment loss, as a function of C's parameters, goes up.
    _, after_corruption_step = loss_at(state.params, new_state.corruption_params)
    assert after_corruption_step["align"] > before["align"]
    # The classifier descends: its loss with C fixed goes down.
    after_total, _ = loss_at(new_state.params, state.corruption_params)
    assert after_total < before_total
    np.testing.assert_allclose(metrics["loss"], before_total, rtol=1e-5)


def test_resume_is_bitwise_equal_to_an_uninterrupted_run(digits_data_dir, tmp_path, caplog):
    config = smoke_config(digits_data_dir, total_steps=6, checkpoint_every_steps=100, ema_decay=0.9)
    full = train.train_and_evaluate(config, str(tmp_path / "full"))
    first = train.train_and_evaluate(
        config, str(tmp_path / "resumed"), should_stop=lambda step: step == 3
    )
    assert first["step"] == 3
    with caplog.at_level(logging.INFO):
        resumed = train.train_and_evaluate(config, str(tmp_path / "resumed"))
    assert "Resumed from" in caplog.text
    assert resumed["step"] == 6
    leaves_full = jax.tree.leaves(full["state"])
    leaves_resumed = jax.tree.leaves(resumed["state"])
    assert len(leaves_full) == len(leaves_resumed)
    for a, b in zip(leaves_full, leaves_resumed):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert full["eval"]["accuracy"] == resumed["eval"]["accuracy"]


def _compile_counter():
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *_, **__: events.append(name) if "compile" in name else None
    )
    return events


@pytest.mark.parametrize(
    "overrides,error,match",
    [
        ({"model_name": "deit_smal"}, ValueError, "unknown model 'deit_smal'.*Registered models"),
        (
            {"rspc.rho": 1.5},
            ValueError,
            r"config.rspc.rho=1.5 is out of range: must be in \(0, 1\)",
        ),
        (
            {"rspc.rho": 0.0},
            ValueError,
            r"config.rspc.rho=0.0 is out of range: must be in \(0, 1\)",
        ),
        (
            {"image_size": 30},
            ValueError,
            "image_size 30 is not divisible by the model patch_size 8",
        ),
        ({"rspc.patch_size": 7}, ValueError, "not divisible by the rspc.patch_size 7"),
        ({"rspc.noise_space": "raw"}, ValueError, "rspc.noise_space"),
        ({"model.depth_typo": 3}, ValueError, "bad override for model 'vit_demo'"),
        ({"dataset": "cifar10"}, datasets.DatasetNotFoundError, "tfds build cifar10"),
        (
            {"init_from": "/nonexistent/rvt.pth.tar"},
            ValueError,
            "config.init_from: checkpoint /nonexistent/rvt.pth.tar does not exist",
        ),
        ({"init_head": "resize"}, ValueError, "config.init_head='resize' is not one of"),
        ({"sharding": "zero3"}, ValueError, "config.sharding='zero3' is not one of 'replicated'"),
    ],
)
def test_bad_input_fails_before_any_compile(digits_data_dir, tmp_path, overrides, error, match):
    config = smoke_config(digits_data_dir, **overrides)
    if overrides.get("dataset") == "cifar10":
        config.data_dir = str(tmp_path / "empty")
        config.augment = "cifar"
    compiles = _compile_counter()
    with pytest.raises(error, match=match):
        train.train_and_evaluate(config, str(tmp_path / "run"))
    assert not compiles
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_non_finite_loss_stops_with_the_step_and_saves_nothing(digits_data_dir, tmp_path):
    config = smoke_config(
        digits_data_dir, **{"optimizer.lr": 1e12, "total_steps": 4, "checkpoint_every_steps": 100}
    )
    with pytest.raises(FloatingPointError, match=r"step \d was not finite"):
        train.train_and_evaluate(config, str(tmp_path / "run"))
    assert not os.listdir(tmp_path / "run" / "checkpoints")


def test_demo_smoke_end_to_end_through_main(demo_run):
    workdir, result = demo_run
    assert "Done: 6 steps; test accuracy" in result.stderr  # absl logging
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    assert any('"eval/accuracy"' in line for line in lines)
    assert any('"eval_ema/accuracy"' in line for line in lines)
    assert any('"train/align"' in line for line in lines)
    assert sorted(os.listdir(workdir / "checkpoints")) == ["3", "6"]
    assert (workdir / "config.json").exists()
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(workdir))


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_saves_a_checkpoint_and_the_same_command_resumes(
    digits_data_dir, tmp_path, stop_signal
):
    workdir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "rspc_jax.main",
        "--config=configs/demo.py:smoke",
        f"--workdir={workdir}",
        f"--config.data_dir={digits_data_dir}",
        "--config.total_steps=100000",
        "--config.checkpoint_every_steps=100000",
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:  # the loop's lines are absl log lines on stderr
        for line in proc.stderr:
            if "] [train] step 4/" in line:
                signalled = time.monotonic()
                proc.send_signal(stop_signal)
                break
        out = proc.stderr.read()
        assert proc.wait(timeout=120) == 0
        exit_seconds = time.monotonic() - signalled
    finally:
        proc.kill()
    assert "Stopped at step" in out
    # A preemption notice gives about 30 s; the save and the exit must fit well inside.
    assert exit_seconds < 30, exit_seconds
    stopped = int(out.split("Stopped at step ")[1].split(":")[0])
    assert stopped >= 4 and os.listdir(workdir / "checkpoints") == [str(stopped)]
    # The same command but a shorter length, accepted as a change, so that the test ends.
    shorter = [f"--config.total_steps={stopped + 2}", "--accept_config_change"]
    result = run_python(command[1:-2] + shorter, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Resumed from {workdir}/checkpoints/{stopped}" in result.stderr
    assert f"Done: {stopped + 2} steps" in result.stderr


def test_noise_space_and_clamp_switches_resolve_to_the_right_numbers(digits_data_dir):
    spec = datasets.dataset_spec("sklearn_digits")
    official = setup.step_settings(smoke_config(digits_data_dir), spec).rspc
    assert official.noise_mean == (0.0,) and official.noise_std == (
        1.0,
    )  # U[0,1) as normalised values
    lower, upper = rspc.normalized_limits(rspc.IMAGENET_MEAN, rspc.IMAGENET_STD)
    np.testing.assert_allclose(official.clamp_lower, lower)  # ImageNet limits even off ImageNet
    np.testing.assert_allclose(official.clamp_upper, upper)
    pixel = setup.step_settings(
        smoke_config(digits_data_dir, **{"rspc.noise_space": "pixel", "rspc.clamp": "dataset"}),
        spec,
    ).rspc
    # Pixel-space U[0,1) noise, normalised with the dataset's statistics.
    assert pixel.noise_mean == spec.mean and pixel.noise_std == spec.std
    np.testing.assert_allclose(pixel.clamp_lower, (0 - np.array(spec.mean)) / spec.std, rtol=1e-6)
    unclamped = rspc.settings_from_config(
        smoke_config(digits_data_dir, **{"rspc.clamp": "none"}), spec
    )
    assert unclamped.clamp_lower is None and unclamped.clamp_upper is None
    identity = rspc.settings_from_config(
        smoke_config(digits_data_dir, **{"rspc.ste": "identity"}), spec
    )
    assert identity.ste_clip is None and official.ste_clip == 1.0


@contextlib.contextmanager
def _on_compile_of(function_name: str, hook):
    """Calls `hook()` whenever XLA compiles a jitted function whose name contains
    `function_name`, inside the block."""

    def on_compile(name, secs, fun_name="", **kwargs):
        if name == "/jax/core/compile/backend_compile_duration" and function_name in fun_name:
            hook()

    jax.monitoring.register_event_duration_secs_listener(on_compile)
    try:
        yield
    finally:
        jax.monitoring.unregister_event_duration_listener(on_compile)


def test_steps_between_log_steps_never_wait_for_the_device(digits_data_dir, tmp_path, monkeypatch):
    """The steady-state loop: under jax.transfer_guard('disallow'), and neither
    device_get nor block_until_ready is called except at the first, log, eval,
    checkpoint and last steps."""
    config = smoke_config(
        digits_data_dir,
        total_steps=8,
        log_every_steps=3,
        eval_every_steps=100,
        checkpoint_every_steps=100,
        block_each_step="no",
        transfer_guard="disallow",
    )
    executed, waits = [0], []

    def count():
        executed[0] += 1

    on_each_train_call(monkeypatch, lambda steps: count())

    def recording(fn):
        def wrapper(*args, **kwargs):
            waits.append(executed[0])
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(jax, "device_get", recording(jax.device_get))
    monkeypatch.setattr(jax, "block_until_ready", recording(jax.block_until_ready))
    result = train.train_and_evaluate(config, str(tmp_path / "run"))
    assert result["step"] == 8 and executed[0] == 8
    assert set(waits) - {0} <= {1, 3, 6, 8}, sorted(set(waits))
    assert {1, 3, 6, 8} <= set(waits)  # the counters do see the sync steps


def test_the_step_compiles_and_memory_returns_to_the_os_before_the_first_step(
    digits_data_dir, tmp_path, monkeypatch
):
    """What the compiler freed is released before the first step allocates its buffers, so
    the process peak does not hold both; the step then runs from the cache (one compile).
    Each blocked step call then waits for its compiled temporaries to come back."""
    config = smoke_config(digits_data_dir, total_steps=2, eval_every_steps=100)
    events = []
    on_each_train_call(monkeypatch, lambda steps: events.append("step"))
    monkeypatch.setattr(host_memory, "release_freed_memory", lambda: events.append("release"))

    @contextlib.contextmanager
    def temporaries_returned(temp_bytes):
        events.append(temp_bytes)
        yield
        events.append("returned")

    monkeypatch.setattr(host_memory, "temporaries_returned", temporaries_returned)
    with _on_compile_of("train_step", lambda: events.append("compile")):
        train.train_and_evaluate(config, str(tmp_path / "run"))
    temp_bytes = events[3]
    assert isinstance(temp_bytes, int) and temp_bytes > 0, events
    # Released after compiling the step and after creating the state (its initialiser compiles).
    steps = [temp_bytes, "step", "returned"] * 2
    assert events[:9] == ["compile", "release", "release", *steps], events
    assert events.count("compile") == 1
    assert events[-1] == "release"  # after the last step's evaluation compiled the eval steps


def _rspc_step_both_ways(digits_data_dir, choice_name, cpu_form):
    """The smoke RSPC step compiled with `ops.implementations` choice `choice_name` set to
    its CPU form (the CPU default, results under 'auto') and to 'xla': for each, the
    compiled step and its new state and metrics on the host."""
    config = smoke_config(digits_data_dir)
    spec = datasets.dataset_spec(config.dataset)
    mesh = parallel.create_mesh()
    batch = parallel.to_global(first_batches(config)[0], mesh)
    results = {}
    for choice, value in (("auto", cpu_form), ("xla", "xla")):
        with ops.implementations(**{choice_name: value}):
            model = setup.build_model(config, spec.num_classes)
            parts = setup.build(config, model, spec, mesh, steps_per_epoch=20, total_steps=20)
        state = parts.init(jax.random.PRNGKey(0))
        compiled = parts.train_step.lower(state, batch).compile()
        results[choice] = compiled, jax.device_get(compiled(state, batch))
    return results


def test_on_cpu_the_train_step_is_jitted_with_the_memory_schedule_which_changes_no_value(
    digits_data_dir,
):
    """XLA:CPU's memory-optimized schedule (`ops.compiler_options`, the default) reaches the
    compile of the RSPC step (its temporaries differ from those under XLA's own schedule;
    which is smaller depends on the model and size), and its new state and metrics are
    bitwise the same."""
    results = _rspc_step_both_ways(digits_data_dir, "cpu_schedule", "memory")
    temp = {c: results[c][0].memory_analysis().temp_size_in_bytes for c in results}
    assert temp["auto"] != temp["xla"], (temp["auto"], temp["xla"])
    leaves_auto, leaves_xla = (jax.tree.leaves(results[c][1]) for c in ("auto", "xla"))
    for a, b in zip(leaves_auto, leaves_xla, strict=True):
        np.testing.assert_array_equal(a, b)


def test_on_cpu_onednn_s_products_are_opt_in_and_agree_to_float32_rounding(
    digits_data_dir,
):
    """oneDNN's products reach the compile of the RSPC step only when chosen
    (`cpu_products='onednn'`, each product alone: its fused form crashes XLA:CPU); by
    default the step has none, since a oneDNN program freed while it runs aborts the
    process (tests/test_cpu_stress.py). Chosen, the step's new state and metrics agree
    with jaxlib's default products to float32 rounding."""
    results = _rspc_step_both_ways(digits_data_dir, "cpu_products", "onednn")
    assert not (ops.compiler_options() or {}).get("xla_cpu_use_onednn")
    fusions = {
        c: collections.Counter(re.findall(r'"kind":"(__\w+_fusion)"', results[c][0].as_text()))
        for c in results
    }
    assert fusions["auto"]["__onednn_fusion"] > 0, fusions["auto"]
    assert fusions["xla"]["__onednn_fusion"] == 0, fusions["xla"]
    leaves_auto, leaves_xla = (jax.tree.leaves(results[c][1]) for c in ("auto", "xla"))
    for a, b in zip(leaves_auto, leaves_xla, strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=1e-4, atol=1e-6)


def test_the_state_initialiser_keeps_no_compiled_program(digits_data_dir):
    """A run creates its state once: the initialiser's program (every parameter's
    initialiser) is dropped after the call rather than kept in memory beside the train
    step's, so a second call compiles it again."""
    config = smoke_config(digits_data_dir)
    spec = datasets.dataset_spec(config.dataset)
    model = setup.build_model(config, spec.num_classes)
    parts = setup.build(config, model, spec, parallel.create_mesh(), 20, 20)
    compiles = []
    with _on_compile_of("create_train_state", lambda: compiles.append("compile")):
        first = parts.init(jax.random.PRNGKey(0))
        second = parts.init(jax.random.PRNGKey(0))
    assert len(compiles) == 2, compiles
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True):
        np.testing.assert_array_equal(a, b)
