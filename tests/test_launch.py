"""launch/tpu_vm.sh: the gcloud commands it would run for a v3-32 pod slice (--dry-run,
checked as text), and a clear stop when a required variable is missing."""

import functools
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
    assert "--worker=all" in setup[1] and "-r\\ rspc_jax/requirements-tpu.txt" in setup[1]
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


def test_accelerator_benchmark_script_compiles_every_row_then_times_each(tmp_path):
    """With `echo` as its Python, the script logs each command: every row's two step kinds
    compiled (alone, into the compilation cache), then each row timed with what it adds."""
    log = tmp_path / "bench.log"
    result = subprocess.run(
        ["bash", str(REPO / "launch" / "benchmark_accelerator.sh"), str(log)],
        cwd=REPO,
        env={
            **os.environ,
            "PYTHON": "echo",
            "BATCH": "64",
            "OFFICIAL": "/x/official_step.py",
            "EXTRA_ROWS": "deit_b512||--config=configs/deit_s.py --batch=512|\n",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    lines = log.read_text().splitlines()
    compiles = [
        line for line in lines if line.startswith("-m benchmarks.train_step --compile_only")
    ]
    timed = [line for line in lines if line.startswith("-m benchmarks.train_step --steps=10 ")]
    assert len(compiles) == 18 and len(timed) == 9
    assert lines.index(compiles[-1]) < lines.index(timed[0])  # compiles first, all of them
    for line in compiles:
        config = line[line.index("--config=") :]
        assert sum(t.endswith(config) or f"{config} " in t for t in timed) >= 1, line
    assert timed.pop(1).endswith("--config=configs/deit_s.py --batch=512")  # extra rows: 2nd
    deit = [t for t in timed if "--config=configs/deit_s.py --batch=64" in t]
    assert len(deit) == 3 and sum("compute_dtype=bfloat16" in t for t in deit) == 2
    assert "--compare_timm" in timed[0]
    explicit = "plain@attention=explicit,rspc@attention=explicit"  # cuDNN's A/B
    assert f"--variants={explicit}" in timed[1]
    assert sum("--variants=rspc@attention=explicit" in line for line in compiles) == 1
    official = timed[2]
    assert "--config=configs/rvt_s.py --batch=128" in official
    reference = "echo /x/official_step.py rspc {steps} --model rvt_small_plus --batch 128"
    assert f"--compare_command=rspc={reference} --device cuda" in official


def test_accelerator_benchmark_script_compiles_one_at_a_time_where_asked(tmp_path):
    """COMPILE_JOBS bounds the compiles running at once (TPUs admit one process); by default
    (GPUs) they all start together. Each fake compile logs how many were running with it."""
    python = tmp_path / "python"
    python.write_text(
        "#!/bin/bash\n"
        'if [[ "$*" == *compile_only* ]]; then\n'
        '  touch "$RUNNING/$$"; sleep 0.3; ls "$RUNNING" | wc -l >> "$RUNNING.log"; rm "$RUNNING/$$"\n'
        "fi\n"
        'echo "$@"\n'
    )
    python.chmod(0o755)
    most_at_once = {}
    for jobs in ("0", "1"):
        running = tmp_path / f"running{jobs}"
        running.mkdir()
        result = subprocess.run(
            ["bash", str(REPO / "launch" / "benchmark_accelerator.sh"), str(tmp_path / jobs)],
            cwd=REPO,
            env={
                **os.environ,
                "PYTHON": str(python),
                "COMPILE_JOBS": jobs,
                "RUNNING": str(running),
            },
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        counts = [int(n) for n in (tmp_path / f"running{jobs}.log").read_text().split()]
        assert len(counts) == 16
        most_at_once[jobs] = max(counts)
    assert most_at_once["1"] == 1 and most_at_once["0"] > 1, most_at_once


def test_accelerator_benchmark_script_runs_only_the_named_rows_in_their_order(tmp_path):
    """ONLY picks rows for a short lease, in the order given; the official RVT-S* step is
    timed under bfloat16 autocast beside our bfloat16 step; a name of no row stops it."""
    env = {**os.environ, "PYTHON": "echo", "OFFICIAL": "/x/official_step.py"}
    run = functools.partial(subprocess.run, cwd=REPO, capture_output=True, text=True, timeout=60)
    script = str(REPO / "launch" / "benchmark_accelerator.sh")
    log = tmp_path / "only.log"
    result = run(["bash", script, str(log)], env={**env, "ONLY": "rvt_s_bf16 deit_s_bf16"})
    assert result.returncode == 0, result.stderr
    lines = log.read_text().splitlines()
    timed = [line for line in lines if line.startswith("-m benchmarks.train_step --steps=")]
    compiles = [line for line in lines if "--compile_only" in line]
    assert len(timed) == 2 and len(compiles) == 4
    assert "configs/rvt_s.py" in timed[0] and "configs/deit_s.py" in timed[1]
    assert "--device cuda --autocast bfloat16" in timed[0]
    wrong = run(["bash", script, str(tmp_path / "x.log")], env={**env, "ONLY": "rvt_z"})
    assert wrong.returncode == 2 and "ONLY=rvt_z names none of the rows" in wrong.stderr


def test_create_with_a_config_runs_the_preflight_first_unless_skipped_or_unknown():
    pod = dict(POD, ACCELERATOR="v5litepod-256")
    create = _launch("--dry-run", "create", "--config=configs/rvt_b.py", **pod)
    assert create.returncode == 0, create.stderr
    lines = create.stdout.splitlines()
    assert lines[0].split() == [
        "python",
        "-m",
        "rspc_jax.plan",
        "--config=configs/rvt_b.py",
        "--preflight=v5e-256",
    ]
    assert lines[1].startswith("gcloud compute tpus tpu-vm create rspc")
    skipped = _launch("--dry-run", "create", "--config=configs/rvt_b.py", PREFLIGHT="0", **pod)
    assert "--preflight" not in skipped.stdout
    v3 = _launch("--dry-run", "create", "--config=configs/rvt_b.py", **POD)
    assert "--preflight" not in v3.stdout and "no pre-flight for v3-32" in v3.stderr
