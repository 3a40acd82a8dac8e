"""Stress checks for CPU processes that die rarely: each command runs `--runs` times, one at
a time, beside a CPU-bound process on every core (a shared machine, a laptop, CI), and the
table counts exits 0, aborts (SIGABRT, exit 134) and time-outs per command.

    python -m benchmarks.cpu_stress --check=release --runs=30
    python -m benchmarks.cpu_stress --check=release --runs=30 --products=onednn
    python -m benchmarks.cpu_stress --check=readme --runs=10 --workdir=runs/demo

'release' is the minimal reproducer of the abort in XLA:CPU's oneDNN products (docs/faults.md,
'A CPU process aborts in oneDNN'): each run jits a batched product with the steps' compiler
options (`ops.compiler_options`; `--products=onednn` chooses oneDNN's, the default before the
fix), dispatches it and releases the executable while the run is in flight, `--iterations`
times. 'readme' runs README's CPU commands on the trained demo in `--workdir` (shortened as
tests/test_readme.py shortens them): training (8 steps into a scratch workdir), evaluate,
analyze, export, and a study part.
"""

import gc
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

from absl import app, flags

_CHECK = flags.DEFINE_enum("check", "release", ["release", "readme"], "Which commands to run.")
_RUNS = flags.DEFINE_integer("runs", 10, "Runs of each command.", lower_bound=1)
_ITERATIONS = flags.DEFINE_integer(
    "iterations", 20, "'release': executables released in flight per run.", lower_bound=1
)
_PRODUCTS = flags.DEFINE_enum(
    "products", "auto", ["auto", "onednn", "xla"], "'release': ops.CHOICES['cpu_products']."
)
_WORKDIR = flags.DEFINE_string("workdir", "runs/demo", "'readme': a finished demo run.")
_TIMEOUT = flags.DEFINE_integer("timeout", 600, "Seconds before a run counts as hung.")
_CHILD = flags.DEFINE_bool("child", False, "Internal: run the release loop in this process.")

ABORT_CODES = (134, -6)
# README's CPU commands (evaluate shortened by tests/test_readme.py's flags, its full run
# takes many minutes); {workdir} is the demo's, {scratch} a fresh folder per run.
README_COMMANDS = {
    "train": "rspc_jax.main --config=configs/demo.py --workdir={scratch}/train "
    "--config.total_steps=8",
    "evaluate": "rspc_jax.evaluate --config=configs/demo.py --workdir={workdir} "
    "--suites=clean,corrupted_local,patch_occlusion --config.evaluation.num_examples=32 "
    "--config.evaluation.severities='(1,)' --config.evaluation.occlusion_masks=4 "
    "--out={scratch}/eval",
    "analyze": "rspc_jax.analyze --config=configs/demo.py --workdir={workdir} "
    "--analysis=layer_correlation --out={scratch}/analysis",
    "export": "rspc_jax.export --workdir={workdir} --out={scratch}/demo_vit.safetensors",
    "study": "rspc_jax.study --config=configs/demo_study.py:smoke "
    "--workdir={scratch}/study --seeds=0",
}
_COMMANDS = flags.DEFINE_list(
    "commands", list(README_COMMANDS), f"'readme': which of {', '.join(README_COMMANDS)}."
)


def release_in_flight(iterations: int) -> None:
    """Jits a product, dispatches it and drops every reference to its executable before the
    result is read, so that the run's completion frees the executable: the order in which
    a pass that builds its step, runs it and returns frees it, with the time between widened."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rspc_jax.models import ops

    x = jnp.ones((8, 384, 384), jnp.float32)
    with ops.implementations(cpu_products=_PRODUCTS.value):
        for i in range(iterations):
            step = jax.jit(
                lambda a, i=i: jnp.matmul(a, a) + i, compiler_options=ops.compiler_options()
            )
            result = step(x)
            del step
            jax.clear_caches()
            gc.collect()
            np.asarray(result)


def _burners() -> list[subprocess.Popen]:
    """A CPU-bound process on every core."""
    loop = "while True: pass"
    return [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(os.cpu_count() or 1)]


def _commands() -> dict[str, list[str]]:
    if _CHECK.value == "release":
        args = ["-m", "benchmarks.cpu_stress", "--child", f"--iterations={_ITERATIONS.value}"]
        return {f"release ({_PRODUCTS.value})": args + [f"--products={_PRODUCTS.value}"]}
    workdir = pathlib.Path(_WORKDIR.value).expanduser()
    if not (workdir / "config.json").exists():
        raise app.UsageError(
            f"--workdir={workdir} holds no finished run: train the demo first "
            f"(python -m rspc_jax.main --config=configs/demo.py --workdir={workdir})"
        )
    unknown = set(_COMMANDS.value) - set(README_COMMANDS)
    if unknown:
        raise app.UsageError(f"unknown --commands {sorted(unknown)}: name {list(README_COMMANDS)}")
    return {name: ["-m", *README_COMMANDS[name].split()] for name in _COMMANDS.value}


def _run(args: list[str], workdir: str) -> int | str:
    scratch = tempfile.mkdtemp(prefix="cpu_stress_")
    args = [a.format(workdir=workdir, scratch=scratch).replace("'", "") for a in args]
    # As a user's process runs: no persistent compilation cache (a test's), which would
    # choose jaxlib's products whatever the default (`ops.compiler_options`).
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    try:
        done = subprocess.run(
            [sys.executable, *args], capture_output=True, text=True, timeout=_TIMEOUT.value, env=env
        )
    except subprocess.TimeoutExpired:
        return "timeout"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if done.returncode not in (0, *ABORT_CODES):
        print(done.stderr[-2000:], file=sys.stderr)
    return done.returncode


def main(argv):
    del argv
    if _CHILD.value:
        release_in_flight(_ITERATIONS.value)
        return
    commands = _commands()
    burners = _burners()
    counts = {}
    try:
        for name, args in commands.items():
            start = time.time()
            outcomes = [_run(args, _WORKDIR.value) for _ in range(_RUNS.value)]
            counts[name] = outcomes, time.time() - start
            print(f"{name}: {outcomes}", flush=True)
    finally:
        for burner in burners:
            burner.kill()
    print(f"\n{len(burners)} CPU-bound processes beside each run")
    print(
        f"{'command':<22} {'runs':>5} {'exit 0':>7} {'aborts':>7} {'hung':>5} {'other':>6} {'s/run':>6}"
    )
    for name, (outcomes, seconds) in counts.items():
        aborts = sum(o in ABORT_CODES for o in outcomes)
        hung = outcomes.count("timeout")
        ok = outcomes.count(0)
        other = len(outcomes) - ok - aborts - hung
        print(
            f"{name:<22} {len(outcomes):>5} {ok:>7} {aborts:>7} {hung:>5} {other:>6} "
            f"{seconds / len(outcomes):>6.0f}"
        )


if __name__ == "__main__":
    app.run(main)
