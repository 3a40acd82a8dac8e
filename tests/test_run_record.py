"""A resumed run is the same run: a rerun that changes what the saved run trains is refused
before anything is written, or, with --accept_config_change, recorded with its step and
reported by export, evaluate and the study; a rerun that changes only how the run is logged
or executed resumes silently; imported weights that are not finite stop the run before its
first step, and an evaluation of them before it runs (rspc_jax/interop/run_record.py,
docs/faults.md)."""

import json
import logging
import shutil

from conftest import REPO, run_python, smoke_config
import jax
import numpy as np
import pytest

from rspc_jax import models
from rspc_jax.data import specs as datasets
from rspc_jax.evaluation import run_suites
from rspc_jax.interop import export, run_record, state_dicts
from rspc_jax.training import loop as train

CHANGES = {"batch_size": 32, "optimizer.lr": 0.01, "total_steps": 6}


def _text(message) -> str:
    return " ".join(str(message).split())


def _files(workdir) -> dict:
    return {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def stopped_run(digits_data_dir, tmp_path_factory):
    """A smoke run of 4 steps stopped after step 2, its checkpoint at step 2."""
    config = smoke_config(digits_data_dir, total_steps=4, checkpoint_every_steps=2)
    workdir = tmp_path_factory.mktemp("record") / "base"
    result = train.train_and_evaluate(config, str(workdir), should_stop=lambda step: step >= 2)
    assert result["step"] == 2
    return config, workdir


def _copy(stopped_run, tmp_path):
    config, base = stopped_run
    return config.copy_and_resolve_references(), shutil.copytree(base, tmp_path / "run")


def test_a_rerun_that_changes_what_is_trained_is_refused_and_writes_nothing(stopped_run, tmp_path):
    config, workdir = _copy(stopped_run, tmp_path)
    before = _files(workdir)
    flags = [f"--config.{key}={value}" for key, value in CHANGES.items()]
    result = run_python(
        [
            "-m",
            "rspc_jax.main",
            f"--config={REPO}/configs/demo.py:smoke",
            f"--workdir={workdir}",
            f"--config.data_dir={config.data_dir}",
            "--config.checkpoint_every_steps=2",
            *flags,
        ],
        timeout=300,
    )
    text = _text(result.stderr)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert f"batch_size {config.batch_size} → 32" in text
    assert f"optimizer.lr {config.optimizer.lr} → 0.01" in text
    assert "total_steps 4 → 6" in text and "recomputes the learning-rate schedule" in text
    assert f"--config.batch_size={config.batch_size} " in text
    assert f"--config.optimizer.lr={config.optimizer.lr} " in text
    assert "--accept_config_change" in text
    assert "Train step:" not in result.stderr  # refused before the step compiled
    assert _files(workdir) == before


def test_an_accepted_change_trains_on_and_the_record_keeps_both_settings(
    stopped_run, tmp_path, caplog
):
    config, workdir = _copy(stopped_run, tmp_path)
    changed = smoke_config(config.data_dir, checkpoint_every_steps=2, **CHANGES)
    with caplog.at_level(logging.WARNING):
        result = train.train_and_evaluate(changed, str(workdir), accept_config_change=True)
    assert result["step"] == 6
    assert "Settings changed after step 2" in caplog.text
    first, change = run_record.read_history(str(workdir))
    assert first["step"] == 0 and first["config"]["batch_size"] == config.batch_size
    assert change["step"] == 2 and change["config"]["batch_size"] == 32
    assert change["changed"]["optimizer.lr"] == [config.optimizer.lr, 0.01]
    assert json.loads((workdir / "config.json").read_text())["batch_size"] == 32
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "config_change" in r] == [2]
    events = b"".join(p.read_bytes() for p in workdir.glob("events.out.tfevents.*"))
    assert b"config_change" in events
    # The weights of step 6 were trained through the change; those of step 2 were not.
    assert "after step 2: batch_size" in run_record.changes_note(str(workdir))
    assert run_record.changes_note(str(workdir), step=2) is None
    summary = export.export(str(workdir), str(tmp_path / "w.safetensors"))
    assert "changed on the way (after step 2: batch_size" in summary
    run_suites.run_suites(changed, workdir=str(workdir), suites="clean", out=str(tmp_path / "e"))
    report = _text((tmp_path / "e" / "report.md").read_text())
    assert f"Note: the settings of the run in {workdir} changed on the way (after step 2" in report
    # Rerun unchanged now, the run is finished and its record stays as it was.
    record = _files(workdir)
    assert train.train_and_evaluate(changed, str(workdir))["step"] == 6
    assert _files(workdir) == record


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"log_every_steps": 1, "eval_every_steps": 1, "checkpoint_every_steps": 1},
    ],
    ids=["unchanged", "logging_cadence"],
)
def test_a_rerun_that_changes_nothing_trained_resumes_silently(
    stopped_run, tmp_path, caplog, overrides
):
    config, workdir = _copy(stopped_run, tmp_path)
    for key, value in overrides.items():
        config[key] = value
    with caplog.at_level(logging.INFO):
        result = train.train_and_evaluate(config, str(workdir))
    assert result["step"] == 4
    assert f"Resumed from {workdir}/checkpoints/2" in caplog.text
    assert "Settings changed" not in caplog.text
    assert not (workdir / run_record.HISTORY).exists()
    assert run_record.changes_note(str(workdir)) is None


def test_what_counts_as_a_change_of_the_math():
    """An allow-list: listed fields pass, any other field (also one the saved config lacks)
    is a change, and the accumulation counts only with BatchNorm."""
    saved = {"log_every_steps": 50, "evaluation": {"suites": "clean"}, "grad_accum_steps": 1}
    new = dict(saved, log_every_steps=1, evaluation={"suites": "clean,adversarial"})
    assert run_record.math_changes(saved, new, batch_norm=lambda: True) == {}
    new = dict(new, grad_accum_steps=2, new_field=True)
    assert run_record.math_changes(saved, new, batch_norm=lambda: False) == {
        "new_field": (run_record.ABSENT, True)
    }
    assert set(run_record.math_changes(saved, new, batch_norm=lambda: True)) == {
        "grad_accum_steps",
        "new_field",
    }


def _state_dict_with_nan(config) -> dict:
    """The smoke model's initial weights under the official keys, one tensor NaN."""
    model = models.from_config(config, datasets.dataset_spec(config.dataset).num_classes)
    variables = model.init(
        jax.random.PRNGKey(0), np.zeros((1, config.image_size, config.image_size, 3)), train=False
    )
    weights = state_dicts.export_state_dict(variables)
    weights["head.weight"] = np.full_like(weights["head.weight"], np.nan)
    return weights


@pytest.mark.parametrize("suffix", [".pth", ".safetensors", ".npz"])
def test_imported_weights_that_are_not_finite_stop_the_run_before_its_first_step(
    digits_data_dir, tmp_path, suffix
):
    config = smoke_config(digits_data_dir, total_steps=2)
    path = str(tmp_path / f"diverged{suffix}")
    weights = _state_dict_with_nan(config)
    if suffix == ".pth":
        state_dicts.save_torch(path, weights)
    elif suffix == ".safetensors":
        state_dicts.save_safetensors(path, weights)
    else:
        np.savez(path, **weights)
    config.init_from = path
    workdir = tmp_path / "run"
    with pytest.raises(state_dicts.NonFiniteWeightsError) as error:
        train.train_and_evaluate(config, str(workdir))
    assert f"checkpoint {path} holds values that are not finite" in _text(error.value)
    assert "in 1 of its" in _text(error.value) and "head.weight" in _text(error.value)
    assert list((workdir / "checkpoints").iterdir()) == []
    assert not (workdir / "metrics.jsonl").exists()
    # evaluate and analyze read --checkpoint through the same loader.
    model = models.from_config(config, datasets.dataset_spec(config.dataset).num_classes)
    with pytest.raises(state_dicts.NonFiniteWeightsError, match="head.weight"):
        run_suites.load_variables(
            config, model, workdir=None, checkpoint=path, step=None, ema=False
        )
