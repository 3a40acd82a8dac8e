"""launch/tpu_vm.sh: the gcloud commands it would run for a v3-32 pod slice (--dry-run,
checked as text), and a clear stop when a required variable is missing."""

import os
import subprocess

import pytest

from tests.conftest import REPO

POD = dict(
    PROJECT="my-project",
    ZONE="europe-west4-a",
    TPU_NAME="rspc",
    BUCKET="my-bucket",
    ACCELERATOR="v3-32",
)


def _launch(*args, **env):
    clean = {k: v for k, v in os.environ.items() if k not in POD and k not in ("SPOT", "QUEUED")}
    return subprocess.run(
        ["bash", str(REPO / "launch" / "tpu_vm.sh"), *args],
        cwd=REPO,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_dry_run_of_a_v3_32_pod_prints_the_gcloud_commands():
    where = "--zone=europe-west4-a --project=my-project"
    create = _launch("--dry-run", "create", SPOT="1", **POD)
    assert create.returncode == 0, create.stderr
    assert (
        f"gcloud compute tpus tpu-vm create rspc {where} --accelerator-type=v3-32 "
        "--version=tpu-ubuntu2204-base --spot"
    ) in create.stdout
    queued = _launch("--dry-run", "create", QUEUED="1", **POD).stdout
    assert (
        f"gcloud compute tpus queued-resources create rspc --node-id=rspc {where} "
        "--accelerator-type=v3-32 --runtime-version=tpu-ubuntu2204-base"
    ) in queued
    setup = _launch("--dry-run", "setup", **POD).stdout.splitlines()
    assert setup[0].startswith("gcloud compute tpus tpu-vm scp --recurse ")
    assert f"rspc:\\~/rspc_jax {where} --worker=all" in setup[0]
    assert "--worker=all" in setup[1] and "jax\\[tpu\\]==0.10.2" in setup[1]
    train = _launch("--dry-run", "train", "--config=configs/rvt_b.py", **POD).stdout
    assert f"gcloud compute tpus tpu-vm ssh rspc {where} --worker=all --command" in train
    for part in (
        "TFDS_DATA_DIR=gs://my-bucket/tfds",
        "python -m rspc_jax.main",
        "--config=configs/rvt_b.py",
        "--workdir=gs://my-bucket/rspc_runs/rspc",
        "--config.distributed=yes",
    ):
        assert part in train.replace("\\", ""), part
    resume = _launch("--dry-run", "resume", "--config=configs/rvt_b.py", **POD).stdout.splitlines()
    assert [line.split()[4] for line in resume] == ["delete", "create", "scp", "ssh", "ssh"]
    assert "--worker=0" in _launch("--dry-run", "logs", **POD).stdout
    assert "tpu-vm delete rspc" in _launch("--dry-run", "delete", **POD).stdout


@pytest.mark.parametrize(
    "missing,command",
    [("PROJECT", "create"), ("ZONE", "setup"), ("ACCELERATOR", "create"), ("BUCKET", "train")],
)
def test_a_missing_variable_stops_the_script_and_names_it(missing, command):
    env = {k: v for k, v in POD.items() if k != missing}
    result = _launch("--dry-run", command, "--config=configs/demo.py", **env)
    assert result.returncode == 2
    assert f"set {missing} (" in result.stderr
    assert "gcloud" not in result.stdout


def test_train_needs_a_config_and_an_unknown_command_shows_the_usage():
    assert "needs --config" in _launch("--dry-run", "train", **POD).stderr
    unknown = _launch("--dry-run", "launch", **POD)
    assert unknown.returncode == 2 and "usage:" in unknown.stderr


def test_accelerator_benchmark_script_runs_every_table_row(tmp_path):
    """With `echo` as its Python, the script logs the benchmark command of each row."""
    log = tmp_path / "bench.log"
    result = subprocess.run(
        ["bash", str(REPO / "launch" / "benchmark_accelerator.sh"), str(log)],
        cwd=REPO,
        env={**os.environ, "PYTHON": "echo", "BATCH": "64"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    runs = [
        line
        for line in log.read_text().splitlines()
        if line.startswith("-m rspc_jax.benchmark --steps=10 ")
    ]
    assert len(runs) == 10
    assert runs[0].endswith("--config=configs/rvt_ti.py --batch=8")
    for config, bf16_rows in (("deit_s", 2), ("rvt_s", 1), ("fan_s_hybrid", 1)):
        rows = [r for r in runs if f"--config=configs/{config}.py --batch=64" in r]
        assert len(rows) == bf16_rows + 1
        assert sum("compute_dtype=bfloat16" in r for r in rows) == bf16_rows
