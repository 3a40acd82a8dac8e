"""One workdir, one run (rspc_jax.training.workdir_lock): a second run on a live lock is
refused in one paragraph before it compiles anything, a lock whose run is gone is taken
over, --force_unlock takes any lock. The module's own tests need no JAX."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

from conftest import FAST_COMPILE, REPO, run_python, smoke_config
import pytest

from rspc_jax.training import workdir_lock


def _dead_pid() -> int:
    """The pid of a process that has ended (and was reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _write_lock(workdir, pid: int, *, host=None, heartbeat_age_s: float = 0.0) -> None:
    """A run.lock as another run leaves it."""
    now = time.time()
    holder = workdir_lock.Holder(
        host=host or socket.gethostname(),
        pid=pid,
        boot_id=workdir_lock._boot_id(),
        started=now - 3600,
        heartbeat=now - heartbeat_age_s,
        token="other",
    )
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, workdir_lock.LOCK_NAME), "wb") as f:
        f.write(workdir_lock._encode(holder))


def _text(result) -> str:
    """stderr with the line wrapping of the one-paragraph error undone."""
    return " ".join(result.stderr.split())


def test_a_lock_records_its_run_and_is_removed_on_release(tmp_path):
    lock = workdir_lock.acquire(str(tmp_path))
    record = json.loads((tmp_path / "run.lock").read_text())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    assert record["token"] == lock.holder.token
    lock.release()
    assert not (tmp_path / "run.lock").exists()


def test_a_live_lock_is_refused_naming_its_holder(tmp_path):
    lock = workdir_lock.acquire(str(tmp_path))
    try:
        with pytest.raises(workdir_lock.WorkdirLockedError) as error:
            workdir_lock.acquire(str(tmp_path))
    finally:
        lock.release()
    message = str(error.value)
    for part in (f"pid {os.getpid()} on host {socket.gethostname()}", "--force_unlock"):
        assert part in message


@pytest.mark.parametrize(
    "holder",
    [
        dict(pid="dead"),  # same host, no such process
        dict(pid=1, host="another-host", heartbeat_age_s=workdir_lock.STALE_AFTER_S + 60),
    ],
    ids=["dead-pid-on-this-host", "silent-other-host"],
)
def test_a_lock_whose_run_is_gone_is_taken_over_with_a_warning(tmp_path, caplog, holder):
    pid = _dead_pid() if holder["pid"] == "dead" else holder["pid"]
    _write_lock(tmp_path, **{**holder, "pid": pid})
    with caplog.at_level(logging.WARNING):
        lock = workdir_lock.acquire(str(tmp_path))
    lock.release()
    assert "Taking over the workdir lock" in caplog.text and "its run is gone" in caplog.text


def test_a_recent_lock_of_another_host_is_refused_unless_forced(tmp_path):
    _write_lock(tmp_path, 1, host="another-host", heartbeat_age_s=30)
    with pytest.raises(workdir_lock.WorkdirLockedError, match="pid 1 on host another-host"):
        workdir_lock.acquire(str(tmp_path))
    workdir_lock.acquire(str(tmp_path), force=True).release()


def test_the_heartbeat_is_refreshed_and_a_lock_taken_over_stops_the_run(tmp_path):
    lock = workdir_lock.acquire(str(tmp_path), heartbeat_s=0.05)
    first = lock.holder.heartbeat
    time.sleep(0.3)
    assert json.loads((tmp_path / "run.lock").read_text())["heartbeat"] > first
    lock.check()
    _write_lock(tmp_path, 1, host="another-host")  # e.g. a --force_unlock elsewhere
    time.sleep(0.3)
    with pytest.raises(workdir_lock.WorkdirLockedError, match="another run took over"):
        lock.check()
    lock.release()
    assert json.loads((tmp_path / "run.lock").read_text())["token"] == "other"  # left alone


def test_an_unreadable_lock_counts_from_its_file_time(tmp_path):
    path = tmp_path / "run.lock"
    path.write_text("")  # a run killed between creating the file and writing it
    with pytest.raises(workdir_lock.WorkdirLockedError, match="cannot be read"):
        workdir_lock.acquire(str(tmp_path))
    old = time.time() - workdir_lock.STALE_AFTER_S - 60
    os.utime(path, (old, old))
    workdir_lock.acquire(str(tmp_path)).release()


def _main_args(workdir, data_dir, *extra) -> list[str]:
    """`python -m rspc_jax.main` of the smoke config: the arguments after `python`."""
    return [
        "-m",
        "rspc_jax.main",
        "--config=configs/demo.py:smoke",
        f"--config.data_dir={data_dir}",
        f"--workdir={workdir}",
        *extra,
    ]


def _train_steps(workdir) -> list[int]:
    from rspc_jax.training import reporting

    rows = reporting.read_metrics(str(workdir / "metrics.jsonl"))
    return [r["step"] for r in rows if "train/loss" in r]


def test_a_second_run_on_a_live_workdir_is_refused_and_the_first_finishes(
    digits_data_dir, tmp_path
):
    workdir = tmp_path / "run"
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count=1 {FAST_COMPILE}",
        PYTHONPATH=str(REPO),
    )
    first = subprocess.Popen(
        [sys.executable, *_main_args(workdir, digits_data_dir)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 120
        while not (workdir / "run.lock").exists():
            assert first.poll() is None and time.time() < deadline, "no lock taken"
            time.sleep(0.1)
        first.send_signal(signal.SIGSTOP)  # alive for as long as the second run takes
        start = time.time()
        second = run_python(_main_args(workdir, digits_data_dir), timeout=120)
        refused_after = time.time() - start
        first.send_signal(signal.SIGCONT)
        assert first.wait(timeout=300) == 0, first.stderr.read()[-3000:]
    finally:
        first.kill()
    assert second.returncode == 1, second.stderr
    assert "rspc_jax.main: error: the workdir" in second.stderr
    assert f"pid {first.pid} on host {socket.gethostname()}" in _text(second)
    assert "Traceback" not in second.stderr
    assert refused_after < 60
    steps = _train_steps(workdir)
    assert steps == sorted(set(steps)) and steps[-1] == 6  # one row per logged step
    assert not (workdir / "run.lock").exists()


def test_force_unlock_takes_a_lock_that_looks_alive(digits_data_dir, tmp_path):
    workdir = tmp_path / "run"
    _write_lock(workdir, os.getpid())  # this test's process: alive, but not a run
    result = run_python(_main_args(workdir, digits_data_dir, "--force_unlock"), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Taking over the workdir lock" in result.stderr and "--force_unlock" in result.stderr
    assert _train_steps(workdir)[-1] == 6
    assert not (workdir / "run.lock").exists()


def test_a_stale_lock_is_taken_over_and_the_run_resumes(digits_data_dir, tmp_path, caplog):
    from rspc_jax.training import loop

    workdir = tmp_path / "run"
    config = smoke_config(digits_data_dir)
    loop.train_and_evaluate(config, str(workdir), should_stop=lambda step: step >= 3)
    _write_lock(workdir, _dead_pid())  # what a killed run leaves
    with caplog.at_level(logging.INFO):
        result = loop.train_and_evaluate(config, str(workdir))
    assert result["step"] == 6
    assert "its run is gone" in caplog.text and "Resumed from" in caplog.text
    assert not (workdir / "run.lock").exists()
