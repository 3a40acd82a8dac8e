"""The abort in XLA:CPU's oneDNN products (docs/faults.md, 'A CPU process aborts in oneDNN'):
with the steps' default compiler options, executables released while they run never abort
or hang a process, beside a CPU-bound process on every core (benchmarks/cpu_stress.py, the
reproducer; with `--products=onednn` it aborts or hangs some runs)."""

import re

from tests.conftest import run_python


def test_executables_released_in_flight_with_the_default_products_never_abort():
    result = run_python(
        ["-m", "benchmarks.cpu_stress", "--check=release", "--runs=4", "--iterations=10"],
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    row = re.search(
        r"^release \(auto\)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)", result.stdout, re.M
    )
    assert row, result.stdout
    runs, ok, aborts, hung, other = map(int, row.groups())
    assert (runs, ok, aborts, hung, other) == (4, 4, 0, 0, 0), result.stdout
