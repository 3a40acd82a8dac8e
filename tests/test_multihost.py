"""Two JAX processes on localhost (jax.distributed, gloo CPU collectives), 2 simulated
devices each, train the smoke demo through the real loop (per-host input splits, the
global batch assembled from per-host batches, checkpoints written by both hosts); the
result must equal one process on 4 devices fed the same global batches."""

import os
import socket
import subprocess
import sys
import textwrap

import jax
import numpy as np

from rspc_jax.interop import checkpoints as checkpointing
from tests.conftest import FAST_COMPILE, REPO, run_python

_TRAIN = textwrap.dedent("""
    import sys
    import jax
    import numpy as np
    from rspc_jax import parallel
    from rspc_jax.data import train as train_data
    from rspc_jax.training import loop as train
    from tests.conftest import smoke_config

    data_dir, workdir, mode = sys.argv[1:4]
    config = smoke_config(data_dir, batch_size=8, eval_batch_size=304)
    if mode == "reference":
        # One process, fed the global batches two hosts would assemble: host 0's local
        # batch then host 1's, each from its own split and shuffle.
        original = train_data.train_iterator

        def two_host_batches(*, local_batch_size, **kwargs):
            hosts = [original(local_batch_size=local_batch_size // 2, process_index=i,
                              process_count=2, **kwargs) for i in range(2)]
            for parts in zip(*hosts):
                yield {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

        train_data.train_iterator = two_host_batches
    else:
        parallel.maybe_initialize_distributed(config.distributed)
        assert jax.process_count() == 2, jax.process_count()
    assert jax.device_count() == 4, jax.devices()
    result = train.train_and_evaluate(config, workdir)
    print("process", jax.process_index(), "step", result["step"], "accuracy",
          result["eval"]["accuracy"], flush=True)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _final_state(workdir):
    step, state, _ = checkpointing.read_saved_state(str(workdir / "checkpoints"))
    return step, state


def test_two_processes_equal_one_process_with_the_same_global_batches(digits_data_dir, tmp_path):
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        JAX_NUM_PROCESSES="2",
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{_free_port()}",
        XLA_FLAGS=f"--xla_force_host_platform_device_count=2 {FAST_COMPILE}",
    )
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", _TRAIN, digits_data_dir, str(tmp_path / "two"), "distributed"],
            cwd=REPO,
            env=dict(env, JAX_PROCESS_ID=str(i)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        outputs = [w.communicate(timeout=600) for w in workers]
    finally:
        for w in workers:
            w.kill()
    for w, (out, err) in zip(workers, outputs):
        assert w.returncode == 0, out[-2000:] + err[-4000:]
    assert "process 0 step 6" in outputs[0][0] and "process 1 step 6" in outputs[1][0]

    reference = run_python(
        ["-c", _TRAIN, digits_data_dir, str(tmp_path / "one"), "reference"], devices=4, timeout=600
    )
    assert reference.returncode == 0, reference.stderr[-4000:]

    (step_two, two), (step_one, one) = (
        _final_state(tmp_path / "two"),
        _final_state(tmp_path / "one"),
    )
    assert step_two == step_one == 6
    for name in ("params", "corruption_params", "opt_state"):
        for a, b in zip(jax.tree.leaves(two[name]), jax.tree.leaves(one[name])):
            np.testing.assert_allclose(
                np.asarray(a), np.asarray(b), atol=1e-5, rtol=0, err_msg=name
            )
