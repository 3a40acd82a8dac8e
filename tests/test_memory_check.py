"""A run that cannot fit in memory stops before its first step with the numbers and the
fixes; XLA's RESOURCE_EXHAUSTED becomes the same paragraph with the last checkpoint kept; a
finished run, rerun, writes nothing (rspc_jax/training/memory_check.py, docs/faults.md)."""

import logging
import os
import shutil

from conftest import REPO, on_each_train_call, run_python, smoke_config
import jax
import pytest

from rspc_jax import ConfigError
from rspc_jax.training import loop as train
from rspc_jax.training import memory_check

GiB = memory_check.GiB


def _text(message) -> str:
    return " ".join(str(message).split())


def test_a_step_over_a_small_limit_is_refused_before_anything_runs(digits_data_dir, tmp_path):
    workdir = tmp_path / "run"
    result = run_python(
        [
            "-m",
            "rspc_jax.main",
            f"--config={REPO}/configs/demo.py:smoke",
            f"--workdir={workdir}",
            f"--config.data_dir={digits_data_dir}",
        ],
        timeout=300,
        env_extra={memory_check.LIMIT_ENV: "0.001"},
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    text = _text(result.stderr)
    assert "rspc_jax.main: error: the train step does not fit in memory" in text, text
    assert text.endswith("config.memory_check=False runs it anyway."), text  # the last words
    for part in (
        f"the limit is 0.00 GiB ({memory_check.LIMIT_ENV}=0.001)",
        "The run: vit_demo (32,346 parameters) at 32 px, batch_size 64",
        "Nothing was trained or saved",
        "no micro-batch fits",
        "--config.remat=True",
        "a smaller --config.batch_size",
        f"python -m rspc_jax.plan --config={REPO}/configs/demo.py:smoke",
        "--config.memory_check=False runs it anyway",
    ):
        assert part in text, text
    checkpoints = workdir / "checkpoints"
    assert not checkpoints.exists() or not os.listdir(checkpoints)


def test_the_suggested_accumulation_is_the_fewest_micro_batches_that_fit(digits_data_dir):
    """Activations scale with the micro-batch; state and gradients do not, and accumulation
    adds a gradient sum: 2 GiB of state, 1 GiB of gradients, 7 GiB of activations for 64
    images per device (5 GiB limit: at most 4.75 GiB; 8 micro-batches need 4.88)."""
    config = smoke_config(digits_data_dir)
    found = memory_check.Footprint(
        estimate=10 * GiB,
        temporaries=8 * GiB,
        param_bytes=GiB,
        param_count=GiB // 4,
        per_device=64,
        accum_steps=1,
    )
    assert found.at(1) == 10 * GiB
    assert found.at(8) == 4 * GiB + 7 * GiB // 8
    roomy = memory_check.Limit(5 * GiB, "test")
    assert (
        "--config.grad_accum_steps=16 (micro-batches of 4 images per device; the global batch "
        "of 64 stays): about 4.44 GiB" in _text(memory_check.fixes(config, found, roomy))
    )
    assert "`python -m rspc_jax.plan --config=<the run's config file>`" in _text(
        memory_check.fixes(config, found, roomy)
    )  # pytest's arguments hold no --config
    tight = memory_check.Limit(3 * GiB, "test")
    assert "no micro-batch fits: even one image per micro-step (--config.grad_accum_steps=64)" in (
        _text(memory_check.fixes(config, found, tight))
    )
    assert memory_check.fits(int(4.75 * GiB), roomy)  # 5% of the limit is kept free
    assert not memory_check.fits(int(4.8 * GiB), roomy)


def test_a_forced_limit_that_is_not_a_size_is_refused(monkeypatch):
    monkeypatch.setenv(memory_check.LIMIT_ENV, "6GB")
    with pytest.raises(ConfigError, match="RSPC_JAX_MEMORY_LIMIT_GIB='6GB' is not a number"):
        memory_check.limit(resident=0)


def test_this_machines_limit_is_what_it_has_available():
    available = memory_check.host_available_bytes()
    with open("/proc/meminfo") as f:
        total = int(dict(line.split(":", 1) for line in f)["MemTotal"].split()[0]) * 1024
    assert 0 < available <= total


@pytest.fixture(scope="module")
def finished_run(digits_data_dir, tmp_path_factory):
    """A 2-step smoke run under a generous forced limit, checkpoints at steps 1 and 2."""
    config = smoke_config(
        digits_data_dir, total_steps=2, checkpoint_every_steps=1, eval_every_steps=2
    )
    workdir = tmp_path_factory.mktemp("memory") / "base"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(memory_check.LIMIT_ENV, "1000")
        result = train.train_and_evaluate(config, str(workdir))
    assert result["step"] == 2
    return config, workdir, result


def test_a_finished_run_rerun_writes_nothing(finished_run, tmp_path, caplog):
    config, base, first = finished_run
    workdir = shutil.copytree(base, tmp_path / "run")
    before = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()}
    for _ in range(5):
        with caplog.at_level(logging.INFO):
            result = train.train_and_evaluate(config, str(workdir))
        assert result["step"] == 2
        assert result["eval"] == pytest.approx(first["eval"])
    after = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()}
    assert after == before
    assert f"This run is done: step 2 of 2; its report is at {workdir}/metrics.jsonl" in caplog.text


def test_resource_exhausted_at_a_step_is_the_paragraph_and_the_last_checkpoint_stays(
    finished_run, tmp_path, monkeypatch
):
    config, base, _ = finished_run
    workdir = shutil.copytree(base, tmp_path / "run")
    config = smoke_config(config.data_dir, total_steps=4, checkpoint_every_steps=1)

    def out_of_memory(steps):
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9876543210 bytes."
        )

    on_each_train_call(monkeypatch, out_of_memory)
    with pytest.raises(memory_check.OutOfMemoryError) as error:  # extended on purpose
        train.train_and_evaluate(config, str(workdir), accept_config_change=True)
    text = _text(error.value)
    for part in (
        "the device ran out of memory (RESOURCE_EXHAUSTED: Out of memory while trying",
        "XLA's estimate of the step was",
        "so the estimate was short",
        "The run: vit_demo (32,346 parameters) at 32 px, batch_size 64",
        f"The checkpoint of step 2 in {workdir}/checkpoints is intact",
        "nothing of the failed step was saved",
        "--config.grad_accum_steps=",
    ):
        assert part in text, text
    assert sorted(os.listdir(workdir / "checkpoints")) == ["1", "2"]


def test_a_finished_run_whose_last_checkpoint_is_unreadable_trains_its_last_steps_again(
    finished_run, tmp_path
):
    """The step is compiled (and checked) only once the restore shows that steps are left."""
    config, base, _ = finished_run
    workdir = shutil.copytree(base, tmp_path / "run")
    for data in (workdir / "checkpoints" / "2" / "state").rglob("d/*"):
        os.truncate(data, data.stat().st_size // 2)
    result = train.train_and_evaluate(config, str(workdir))
    assert result["step"] == 2
    assert os.listdir(workdir / "checkpoints.unreadable") == ["2"]
    assert sorted(os.listdir(workdir / "checkpoints")) == ["1", "2"]
