"""Fault injection: what a long run on preemptible machines meets (a damaged checkpoint, a
diverging step, a failed save, a kill, a stop signal) and bad input. Each must end with one
clear message and a non-zero exit, and leave nothing on disk inconsistent or lost."""

import errno
import json
import logging
import os
import shutil

from conftest import run_python, smoke_config
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tensorflow as tf
import tensorstore as ts

from rspc_jax import ConfigError
from rspc_jax.interop import checkpoints, state_dicts
from rspc_jax.training import checks, optim, reporting, setup
from rspc_jax.training import loop as train


@pytest.fixture(scope="module")
def base_run(digits_data_dir, tmp_path_factory):
    """A 6-step smoke run stopped after step 4, with checkpoints at steps 2 and 4 (copied by
    each test, which resumes it with the same settings)."""
    config = _config(digits_data_dir, total_steps=6, checkpoint_every_steps=2)
    workdir = tmp_path_factory.mktemp("faults") / "base"
    train.train_and_evaluate(config, str(workdir), should_stop=lambda step: step >= 4)
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4"]
    return config, workdir


def _config(data_dir, **overrides):
    """The smoke config logging every step (the tests count the records)."""
    return smoke_config(data_dir, log_every_steps=1, **overrides)


def _copy(base, tmp_path):
    shutil.copytree(base, tmp_path / "run")
    return tmp_path / "run"


def _truncate_data_files(step_dir):
    data = [
        os.path.join(root, name)
        for root, _, names in os.walk(step_dir / "state")
        if os.path.basename(root) == "d"
        for name in names
    ]
    assert data
    for path in data:
        os.truncate(path, os.path.getsize(path) // 2)


def _garble_metadata(step_dir):
    (step_dir / "state" / "_METADATA").write_text("{not json at all")


def _text(result) -> str:
    """stderr with the line wrapping of the one-paragraph error undone."""
    return " ".join(result.stderr.split())


def _train_records(workdir):
    return [
        r["step"]
        for r in reporting.read_metrics(str(workdir / "metrics.jsonl"))
        if "train/loss" in r
    ]


@pytest.mark.parametrize("damage", [_truncate_data_files, _garble_metadata])
def test_an_unreadable_latest_checkpoint_is_set_aside_and_the_run_resumes_before_it(
    base_run, tmp_path, caplog, damage
):
    config, base = base_run
    workdir = _copy(base, tmp_path)
    damage(workdir / "checkpoints" / "4")
    with caplog.at_level(logging.WARNING):
        result = train.train_and_evaluate(config, str(workdir))
    assert result["step"] == 6
    assert "checkpoints/4 cannot be read" in caplog.text
    assert "resuming from step 2" in caplog.text
    assert os.listdir(workdir / "checkpoints.unreadable") == ["4"]  # kept, never deleted
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4", "6"]
    assert _train_records(workdir) == [1, 2, 3, 4, 5, 6]


def test_when_no_checkpoint_can_be_read_nothing_is_moved(base_run, tmp_path):
    config, base = base_run
    workdir = _copy(base, tmp_path)
    for step in ("2", "4"):
        _truncate_data_files(workdir / "checkpoints" / step)
    with pytest.raises(
        checkpoints.CheckpointUnreadableError, match="no checkpoint in .* can be read"
    ):
        train.train_and_evaluate(config, str(workdir))
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4"]
    assert not (workdir / "checkpoints.unreadable").exists()


def test_a_checkpoint_of_another_model_is_a_mismatch_not_damage(base_run, tmp_path):
    """Even with the change of the model accepted (--accept_config_change)."""
    config, base = base_run
    workdir = _copy(base, tmp_path)
    wider = _config(config.data_dir, total_steps=6, **{"model.width": 48})
    with pytest.raises(checkpoints.CheckpointMismatchError, match="does not match the state"):
        train.train_and_evaluate(wider, str(workdir), accept_config_change=True)
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4"]
    assert not (workdir / "checkpoints.unreadable").exists()


def test_a_damaged_record_file_is_one_paragraph_and_the_last_checkpoint_stays(base_run, tmp_path):
    config, base = base_run
    workdir = _copy(base, tmp_path)
    damaged = tmp_path / "tfds"
    shutil.copytree(config.data_dir, damaged)
    (record,) = damaged.glob("sklearn_digits/*/sklearn_digits-train.tfrecord*")
    os.truncate(record, os.path.getsize(record) // 2)
    config = config.copy_and_resolve_references()
    config.data_dir = str(damaged)
    with pytest.raises(train.DamagedDataError) as error:
        train.train_and_evaluate(config, str(workdir))
    message = " ".join(str(error.value).split())
    for part in (
        "dataset 'sklearn_digits' is damaged",
        f"{record} cannot be read",
        "truncated record",
        f"tfds build sklearn_digits --data_dir={damaged}",
        "restore the file",
        "The checkpoint of step 4",
        "stays the resume point",
    ):
        assert part in message, message
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4"]


def _poisoned_at(step: int) -> optax.GradientTransformation:
    """Infinite updates at `step` (1-based), as a diverging learning rate would give: the loss
    of that step is still finite (it was computed before the update)."""

    def init(params):
        return jnp.zeros((), jnp.int32)

    def update(updates, count, params=None):
        bad = count == step - 1
        return jax.tree.map(lambda u: jnp.where(bad, jnp.inf, u), updates), count + 1

    return optax.GradientTransformation(init, update)


def _poison_classifier_updates(monkeypatch, step: int) -> None:
    """The classifier's optimizer of every run built from here on is `_poisoned_at(step)`."""
    original = optim.classifier_optimizer
    monkeypatch.setattr(
        optim,
        "classifier_optimizer",
        lambda *args, **kwargs: optax.chain(original(*args, **kwargs), _poisoned_at(step)),
    )


def test_no_checkpoint_ever_holds_what_a_non_finite_step_produced(base_run, tmp_path, monkeypatch):
    config, base = base_run
    _poison_classifier_updates(monkeypatch, 3)
    config = _config(config.data_dir, total_steps=6, checkpoint_every_steps=1)
    workdir = tmp_path / "run"
    with pytest.raises(reporting.NonFiniteLossError, match="step 3 was not finite") as error:
        train.train_and_evaluate(config, str(workdir))
    saved = sorted(int(s) for s in os.listdir(workdir / "checkpoints"))
    assert saved == [1, 2]
    paragraph = " ".join(str(error.value).split())
    assert f"The checkpoint of step 2 in {workdir}/checkpoints is intact" in paragraph
    assert "Lower the learning rate" in paragraph and "initial weights" not in paragraph
    for step in saved:
        _, state, _ = checkpoints.read_saved_state(str(workdir / "checkpoints"), step)
        assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(state))
    # The last checkpoint is step 2 of the same run without the bad step: up to float32
    # rounding, since the poisoned optimizer's extra select is another program, which XLA may
    # fuse differently (one step's update moves these parameters by far more than 1e-5).
    _, last, _ = checkpoints.read_saved_state(str(workdir / "checkpoints"), 2)
    _, reference, _ = checkpoints.read_saved_state(str(base / "checkpoints"), 2)
    for a, b in zip(jax.tree.leaves(last["params"]), jax.tree.leaves(reference["params"])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=0)


def test_a_first_step_that_is_not_finite_points_at_the_initial_weights(
    base_run, tmp_path, monkeypatch
):
    """No checkpoint exists yet, and the paragraph says so; the initial weights (here the
    finite ones of config.init_from, which an update then blows up) are named beside the
    learning rate."""
    config, base = base_run
    _poison_classifier_updates(monkeypatch, 1)
    _, state, _ = checkpoints.read_saved_state(str(base / "checkpoints"), 4)
    weights = tmp_path / "init.npz"
    np.savez(weights, **state_dicts.export_state_dict(state))
    config = _config(config.data_dir, total_steps=2, init_from=str(weights))
    workdir = tmp_path / "run"
    with pytest.raises(reporting.NonFiniteLossError) as error:
        train.train_and_evaluate(config, str(workdir))
    paragraph = " ".join(str(error.value).split())
    assert paragraph.startswith("step 1 was not finite")
    assert "No checkpoint was written yet" in paragraph
    assert f"suspect its initial weights, the weights of config.init_from={weights}" in paragraph
    assert "config.optimizer.lr" in paragraph and "starts the run again from step 0" in paragraph
    assert os.listdir(workdir / "checkpoints") == []


def _failing_writes(step: int):
    """tensorstore.open that fails like a full disk for the files of checkpoint `step`, in
    orbax's background writer (where a real ENOSPC shows up)."""
    real_open = ts.open

    def open_(spec, *args, **kwargs):
        path = json.dumps((spec if isinstance(spec, ts.Spec) else ts.Spec(spec)).to_json())
        if kwargs.get("create") and f"/checkpoints/{step}.orbax-checkpoint-tmp" in path:

            async def fail():
                raise OSError(errno.ENOSPC, "No space left on device")

            return fail()
        return real_open(spec, *args, **kwargs)

    return open_


def test_a_failed_save_stops_the_run_and_the_rerun_resumes_from_the_last_good_one(
    digits_data_dir, tmp_path, monkeypatch
):
    config = _config(digits_data_dir, total_steps=30, checkpoint_every_steps=2, keep_checkpoints=5)
    workdir = tmp_path / "run"
    monkeypatch.setattr(ts, "open", _failing_writes(4))
    with pytest.raises(checkpoints.CheckpointSaveError, match="No space left on device") as error:
        train.train_and_evaluate(config, str(workdir))
    assert "checkpoints/4 failed" in str(error.value) and "([2]) are intact" in str(error.value)
    # Stopped within a few steps of the failure (the poll sees it once orbax's thread ends).
    assert max(_train_records(workdir)) <= 14
    assert "2" in os.listdir(workdir / "checkpoints")
    checkpoints.read_saved_state(str(workdir / "checkpoints"), 2)
    monkeypatch.undo()
    result = train.train_and_evaluate(config, str(workdir))
    assert result["step"] == 30
    assert sorted(os.listdir(workdir / "checkpoints")) == ["22", "24", "26", "28", "30"]
    assert _train_records(workdir) == list(range(1, 31))


# A failed save as orbax leaves it: the writes gathered with the failed one are asyncio tasks
# and futures whose exceptions nobody reads, logged by asyncio ("Task exception was never
# retrieved", "Future exception ...", each with its traceback) when they are collected at exit.
# The coroutine is compiled under a path in orbax, as asyncio names it in the record; the
# future's error names the step's temporary folder, as tensorstore's do.
_ABANDONED_WRITES = """
import asyncio, sys
from rspc_jax import ReportedError
from rspc_jax.tools import cli

writer = {}
source = "async def write():\\n    raise OSError(28, 'No space left on device')\\n"
exec(compile(source, "/site-packages/orbax/checkpoint/_src/serialization.py", "exec"), writer)


def main(argv):
    loop = asyncio.new_event_loop()
    tasks = [loop.create_task(writer["write"]()) for _ in range(3)]
    future = loop.create_future()
    future.set_exception(ValueError("writing /run/checkpoints/4.orbax-checkpoint-tmp/d/0 failed"))
    loop.run_until_complete(asyncio.sleep(0.05))
    raise ReportedError("saving checkpoint 4 failed (OSError: No space left on device).")


sys.argv = ["rspc_jax.main", *sys.argv[1:]]
cli.run(main)
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_the_failed_saves_paragraph_is_the_last_thing_printed(verbose):
    result = run_python(
        ["-c", _ABANDONED_WRITES, "--malloc=system", *(["--verbose"] if verbose else [])],
        timeout=120,
    )
    assert result.returncode == 1
    for leftover in ("Task exception was never retrieved", "Future exception was never"):
        assert (leftover in result.stderr) == verbose, result.stderr  # --verbose shows them
    if not verbose:
        assert result.stderr.startswith("rspc_jax.main: error: saving checkpoint 4 failed")
        assert result.stderr.rstrip().endswith("No space left on device).")


def test_a_resumed_run_logs_each_step_once_and_reads_past_a_cut_last_line(base_run, tmp_path):
    config, base = base_run
    workdir = _copy(base, tmp_path)
    with open(workdir / "metrics.jsonl", "a") as f:  # what a run killed at step 6 leaves
        f.write('{"step": 5, "train/loss": 2.3}\n{"step": 6, "train/loss": 2.3}\n{"step": 7, "tr')
    assert _train_records(workdir) == [1, 2, 3, 4, 5, 6]
    train.train_and_evaluate(config, str(workdir))
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    assert all(json.loads(line) for line in lines)
    assert _train_records(workdir) == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize(
    "flag,field",
    [
        ("--config.optimizer.lr=-0.001", "config.optimizer.lr"),
        ("--config.optimizer.lr=0", "config.optimizer.lr"),
        ("--config.optimizer.warmup_epochs=50", "config.optimizer.warmup_epochs"),
        ("--config.batch_size=0", "config.batch_size"),
        ("--config.eval_batch_size=-8", "config.eval_batch_size"),
        ("--config.num_epochs=0", "config.num_epochs"),
        ("--config.label_smoothing=1.0", "config.label_smoothing"),
        ("--config.ema_decay=1.0", "config.ema_decay"),
        ("--config.model.drop_path_rate=1.0", "config.model.drop_path_rate"),
        ("--config.rspc.lam=-0.1", "config.rspc.lam"),
        ("--config.rspc.rho=0", "config.rspc.rho"),
        ("--config.rspc.optimizer.lr=0", "config.rspc.optimizer.lr"),
        ("--config.keep_checkpoints=0", "config.keep_checkpoints"),
        ("--config.rspc.noise_space=raw", "config.rspc.noise_space"),
        ("--config.model.depth=0", "config.model.depth=0 cannot build a model"),
        ("--config.model.num_heads=-2", "config.model.num_heads=-2 cannot build a model"),
        ("--config.model.mlp_ratio=0", "config.model.mlp_ratio"),
        ("--config.model.width=90", "not divisible by config.model.num_heads=4"),
        ("--config.rspc.rhoo=0.2", "no field 'rhoo'"),
        ("--config=configs/nope.py", "config file 'configs/nope.py' does not exist"),
    ],
)
def test_a_bad_value_is_refused_in_one_paragraph_before_anything_is_built(tmp_path, flag, field):
    workdir = tmp_path / "run"
    args = ["--config=configs/demo.py", flag] if not flag.startswith("--config=") else [flag]
    result = run_python(["-m", "rspc_jax.main", *args, f"--workdir={workdir}"], timeout=120)
    assert result.returncode == 1
    assert field in _text(result)
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("rspc_jax.main: error:")
    assert not workdir.exists()


@pytest.mark.parametrize(
    "model", [dict(depth=(2, 0)), dict(heads=(3, 6.5)), dict(patch_size=0), dict(depths=())]
)
def test_every_models_architecture_fields_are_checked(model):
    config = smoke_config("/nonexistent")
    config.model_name = "rvt_tiny"
    config.model = model
    with pytest.raises(ConfigError, match=f"config.model.{next(iter(model))}=.* cannot build"):
        checks.validate_config(config)


def test_a_workdir_that_cannot_be_written_is_refused(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for workdir, message in ((blocker, "is a file"), (blocker / "run", "cannot write into")):
        result = run_python(
            ["-m", "rspc_jax.main", "--config=configs/demo.py", f"--workdir={workdir}"], timeout=120
        )
        assert result.returncode == 1 and message in _text(result), result.stderr
        assert "Traceback" not in result.stderr


def _unreachable(*args, **kwargs):
    raise tf.errors.FailedPreconditionError(
        None,
        None,
        "Error executing an HTTP request: Could not resolve host: storage.googleapis.com",
    )


def _forbidden(*args, **kwargs):
    raise tf.errors.PermissionDeniedError(None, None, "Error executing an HTTP request: 403")


@pytest.mark.parametrize(
    "call,cause",
    [
        ("makedirs", "FailedPreconditionError: Error executing an HTTP request: Could not resolve"),
        ("GFile", "PermissionDeniedError: Error executing an HTTP request: 403"),
    ],
)
def test_a_bucket_workdir_that_cannot_be_reached_or_written_names_the_causes(
    digits_data_dir, monkeypatch, call, cause
):
    monkeypatch.setattr(tf.io.gfile, "makedirs", _unreachable if call == "makedirs" else print)
    monkeypatch.setattr(tf.io.gfile, "GFile", _forbidden)
    monkeypatch.setattr(setup, "build", None)  # nothing is built, let alone compiled
    with pytest.raises(ConfigError) as error:
        train.train_and_evaluate(_config(digits_data_dir), "gs://nonexistent/run")
    message = str(error.value)
    for part in (
        f"cannot write into --workdir gs://nonexistent/run ({cause}",
        "no credentials (`gcloud auth list`",
        "no network route",
        "`gsutil ls gs://nonexistent`",
        "no permission to write into the bucket",
    ):
        assert part in message, message


def test_the_checks_run_before_jax_and_tensorflow_are_imported():
    code = (
        "import sys\n"
        "from rspc_jax.training import checks\n"
        "from rspc_jax.tools import cli\n"
        "heavy = sorted({'jax', 'tensorflow', 'flax'} & set(sys.modules))\n"
        "assert not heavy, heavy\n"
    )
    result = run_python(["-c", code], timeout=120)
    assert result.returncode == 0, result.stderr


def test_evaluate_and_export_refuse_weights_of_another_width_naming_the_field(base_run, tmp_path):
    config, base = base_run
    workdir = _copy(base, tmp_path)
    result = run_python(
        [
            "-m",
            "rspc_jax.evaluate",
            "--config=configs/demo.py:smoke",
            f"--config.data_dir={config.data_dir}",
            "--config.model.width=48",
            f"--workdir={workdir}",
            "--suites=clean",
        ],
        timeout=300,
    )
    assert result.returncode == 1
    assert "has shape" in _text(result) and "Traceback" not in result.stderr
    assert not (workdir / "eval").exists()
    edited = json.loads((workdir / "config.json").read_text())
    edited["model"]["width"] = 48
    (workdir / "config.json").write_text(json.dumps(edited))
    result = run_python(
        ["-m", "rspc_jax.export", f"--workdir={workdir}", f"--out={tmp_path / 'w.safetensors'}"],
        timeout=300,
    )
    assert result.returncode == 1
    assert "has shape" in _text(result) and "Traceback" not in result.stderr
    assert not (tmp_path / "w.safetensors").exists()
