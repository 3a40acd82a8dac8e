"""The benchmark script runs at smoke size and prints both steps, their ratio, XLA's FLOP
count (RSPC's step does at least twice the plain step's work) and memory estimate."""

import re

from rspc_jax.tools import benchmark
from tests.conftest import run_python

_ROW = r"^{}\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+\d+\.\d+\s+\d+\.\d+\s+(\S+)\s+(\S+)\s+(\d+)\s+(\S+)$"


def _benchmark(*extra):
    result = run_python(
        [
            "-m",
            "rspc_jax.benchmark",
            "--config=configs/demo.py:smoke",
            "--steps=2",
            "--batch=8",
            *extra,
        ],
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_benchmark_prints_plain_rspc_ratio_flops_and_memory():
    out = _benchmark()
    plain = re.search(_ROW.format("plain"), out, re.M)
    rspc = re.search(_ROW.format("rspc"), out, re.M)
    assert plain and rspc, out
    ratio = float(re.search(r"ratio rspc/plain step time: (\d+\.\d+)", out).group(1))
    assert ratio > 0
    assert plain.group(5) == "n/a"  # no MFU on CPU: no known peak
    plain_flops, rspc_flops = float(plain.group(4)), float(rspc.group(4))
    assert plain_flops > 0 and rspc_flops >= 1.9 * plain_flops
    assert int(rspc.group(6)) > 0


def test_peak_flops_by_device_kind_and_dtype():
    assert benchmark.peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4e12
    assert benchmark.peak_flops("NVIDIA H200", "float32") == 494.7e12
    assert benchmark.peak_flops("TPU v4", "bfloat16") == 275e12
    assert benchmark.peak_flops("TPU v3", "float32") is None
    assert benchmark.peak_flops("cpu", "bfloat16") is None


def test_benchmark_counts_every_scanned_block():
    """XLA's cost analysis counts a loop body once; the scanned model does the same work."""
    rows = [
        re.search(_ROW.format("plain"), out, re.M).group(4)
        for out in (
            _benchmark("--variants=plain"),
            _benchmark("--variants=plain", "--config.scan_blocks=True"),
        )
    ]
    assert rows[0] == rows[1]
