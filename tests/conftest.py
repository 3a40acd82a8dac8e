"""Shared test fixtures: the reference fixtures' location, a prepared digits data dir."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
# The suite is dominated by XLA compilation of tiny models: LLVM's backend optimisations
# cost more time than they save here (set before JAX starts; subprocesses get them too).
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()
FIXTURES = REPO.parent / "shared" / "reference" / "fixtures"


def fixture_dir(case: str) -> pathlib.Path:
    path = FIXTURES / case
    if not path.is_dir():
        pytest.skip(f"reference fixture {path} is not available")
    return path


def torch_keys_manifest(name: str) -> dict:
    """The official PyTorch key/shape manifest of full-size model `name`."""
    path = FIXTURES.parent / "torch_keys" / f"{name}.json"
    if not path.is_file():
        pytest.skip(f"reference key manifest {path} is not available")
    return json.loads(path.read_text())


def assert_close(ours, ref, tol: float, name: str) -> None:
    """Parity check against a reference array: same shape, max abs error <= tol."""
    ref = np.asarray(ref)
    assert np.shape(ours) == ref.shape, f"{name}: shape {np.shape(ours)} != {ref.shape}"
    err = float(np.max(np.abs(np.asarray(ours, np.float64) - ref)))
    print(f"{name}: max abs error {err:.3g} (tolerance {tol:.3g})")  # shown with pytest -s
    assert err <= tol, f"{name}: max abs error {err:.3g} > {tol:.3g}"


def assert_trees_equal(ours, ref) -> None:
    """Same tree structure and bitwise equal leaves."""
    import jax

    assert jax.tree.structure(ours) == jax.tree.structure(ref)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def activation_tol(ref) -> float:
    """The fixtures' tolerance for activations: 1e-4 * max(1, max |ref|)."""
    return 1e-4 * max(1.0, float(np.abs(ref).max()))


@pytest.fixture(scope="session")
def digits_data_dir(tmp_path_factory) -> str:
    """The embedded digits dataset, prepared once per session (no network)."""
    from rspc_jax.data import specs as datasets

    data_dir = str(tmp_path_factory.mktemp("tfds"))
    datasets.get_builder("sklearn_digits", data_dir)
    return data_dir


@pytest.fixture(scope="session")
def demo_run(digits_data_dir, tmp_path_factory):
    """configs/demo.py:smoke through `python -m rspc_jax.main` as the README runs it (a
    relative workdir), with an EMA; (workdir, CompletedProcess), run once per session."""
    cwd = tmp_path_factory.mktemp("demo_run")
    result = run_python(
        [
            "-m",
            "rspc_jax.main",
            f"--config={REPO}/configs/demo.py:smoke",
            "--workdir=demo",
            f"--config.data_dir={digits_data_dir}",
            "--config.ema_decay=0.9",
        ],
        timeout=300,
        cwd=cwd,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd / "demo", result


def smoke_config(data_dir: str, **overrides):
    """configs/demo.py:smoke with overrides given as dotted keys."""
    spec = importlib.util.spec_from_file_location("demo_config", REPO / "configs" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    config = demo.get_config("smoke")
    config.data_dir = data_dir
    for key, value in overrides.items():
        node = config
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return config


def run_python(args, *, devices: int = 1, timeout: int = 600, env_extra=None, cwd=REPO):
    """Runs `python args...` in a fresh process (XLA_FLAGS must be set before JAX starts)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, timeout=timeout, capture_output=True, text=True
    )
