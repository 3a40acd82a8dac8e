"""The benchmark script runs at smoke size and prints both steps and their ratio."""

import re

from tests.conftest import run_python


def test_benchmark_prints_plain_rspc_and_ratio():
    result = run_python(["-m", "rspc_jax.benchmark", "--config=configs/demo.py:smoke",
                         "--steps=2", "--batch=8"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert re.search(r"^plain\s+\d+\.\d+\s+\d+\.\d+\s+\d+\.\d+", out, re.M), out
    assert re.search(r"^rspc\s+\d+\.\d+\s+\d+\.\d+\s+\d+\.\d+", out, re.M), out
    ratio = float(re.search(r"ratio rspc/plain step time: (\d+\.\d+)", out).group(1))
    assert ratio > 0
