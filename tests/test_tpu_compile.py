"""The TPU compiler on a CPU host (rspc_jax.tools.tpu_compile, libtpu from the test
requirements, no TPU): the RSPC step compiles for single- and multi-host TPU topologies,
data parallel and FSDP with gradient accumulation; a step it refuses is a "does not fit"
with its figure; the planner's micro-batch fits and the next multiple does not, by the TPU
compiler. All at the demo's smoke model (a full-size step takes minutes)."""

import os
import re
import subprocess
import sys

import jax
import pytest

from rspc_jax.tools import memory_plan, tpu_compile
from tests.conftest import REPO, load_config, run_python, smoke_config

pytestmark = pytest.mark.skipif(
    not tpu_compile.available(),
    reason="libtpu is not installed (pip install -r requirements-tpu.txt)",
)


def test_slice_names_map_to_their_topologies():
    assert tpu_compile.SLICES["v4-8"] == tpu_compile.TpuSlice("v4:2x2x1", 4, 1, 32 * 2**30)
    assert tpu_compile.SLICES["v4-128"].chips == 64
    assert tpu_compile.SLICES["v5e-8"] == tpu_compile.TpuSlice("v5e:2x4", 8, 1, 16 * 2**30)
    assert tpu_compile.SLICES["v5e-256"] == tpu_compile.TpuSlice("v5e:16x16", 256, 64, 16 * 2**30)
    assert tpu_compile.SLICES["v5p-8"].hbm == 95 * 2**30
    mesh = tpu_compile.mesh("v5e-16")
    assert mesh.devices.size == 16
    assert len({d.process_index for d in mesh.devices.flat}) == 4  # a multi-host slice


def test_rspc_step_compiles_data_parallel_and_fsdp_with_accumulation_single_and_multi_host(
    tmp_path,
):
    config = smoke_config(str(tmp_path), grad_accum_steps=2)
    assert config.rspc.enabled
    single = tpu_compile.train_step(config, "v4-8", 8)
    # The demo's model, whose larger parameters FSDP shards (the smoke model's are all
    # under parallel.FSDP_MIN_SIZE).
    _, config = load_config(REPO / "configs" / "demo.py")
    config.data_dir, config.grad_accum_steps, config.sharding = str(tmp_path), 2, "fsdp"
    multi = tpu_compile.train_step(config, "v5e-16", 8)
    for result in (single, multi):
        assert result.fits and not result.refusal
        assert 0 < result.bytes < 0.9 * 16 * 2**30
        assert result.analysis.temp_size_in_bytes > 0

    # The compiled programs take the state as laid out: replicated on every chip, or the
    # parameters and optimizer state sharded over the 16 chips (FSDP).
    def replicated(result):
        state = result.executable.input_shardings[0][0]
        return {s.is_fully_replicated for s in jax.tree.leaves(state)}

    assert replicated(single) == {True}
    assert False in replicated(multi)


def test_a_step_the_tpu_compiler_refuses_does_not_fit_with_its_figure_and_the_fixes(tmp_path):
    # 32768 images per chip of the smoke model: over a v5e chip's 16 GiB.
    result = run_python(
        [
            "-m",
            "rspc_jax.plan",
            "--config=configs/demo.py:smoke",
            "--preflight=v5e-8",
            f"--config.batch_size={8 * 32768}",
            f"--config.data_dir={tmp_path}",
        ],
        timeout=900,
    )
    out = " ".join(result.stdout.split())
    assert result.returncode == 1, result.stderr[-3000:]
    needed = re.search(r"train step: DOES NOT FIT, 32768 images per chip .*?: ([\d.]+) GiB", out)
    assert needed and float(needed.group(1)) > 15, out
    assert "RESOURCE_EXHAUSTED" in out and "TPU compiler" in out
    assert re.search(r"eval step: fits, \d+ images per chip", out), out
    assert "--config.grad_accum_steps=" in out and "Traceback" not in result.stderr


def test_the_planner_s_micro_batch_fits_and_the_next_multiple_does_not(tmp_path):
    config = smoke_config(str(tmp_path), batch_size=8 * 64)
    plain = memory_plan.variant_config(config, "plain")
    # A budget between the TPU's figures at 8 and 16 images per chip: the search must find 8
    # and show 16 not to fit (the compiles are shared with the search).
    at_8, at_16 = (tpu_compile.train_step(plain, "v5e-8", b).bytes for b in (8, 16))
    assert at_8 < at_16
    hbm = 16 * 2**30
    headroom = (at_8 + at_16) / 2 / hbm
    rows = memory_plan.tpu_plan(config, ["plain"], {"v5e-8": (8, hbm)}, headroom)
    (row,) = rows
    assert row.compiler == "TPU" and row.fit == memory_plan.Fit(8, at_8, True)
    assert tpu_compile.train_step(plain, "v5e-8", 8, headroom).fits
    assert not tpu_compile.train_step(plain, "v5e-8", 16, headroom).fits
    assert row.accumulation == (8, 8)  # 64 images per chip in 8 micro-batches of 8


def test_tools_on_a_host_without_a_tpu_run_on_the_cpu_without_libtpu_warnings():
    # libtpu is installed (the test requirements) but this host has no TPU chip: without
    # cli.skip_absent_tpu JAX starts libtpu, which warns about TPU_ACCELERATOR_TYPE.
    script = (
        "from rspc_jax.tools import cli\n"
        "if {skip}: cli.skip_absent_tpu()\n"
        "import jax, os\n"
        "print(jax.default_backend(), os.environ.get('JAX_PLATFORMS'))\n"
    )
    unset = ("JAX_PLATFORMS", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    results = {}
    for skip in (False, True):
        results[skip] = subprocess.run(
            [sys.executable, "-c", script.format(skip=skip)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert results[True].returncode == 0, results[True].stderr
    assert results[True].stdout.split() == ["cpu", "cpu"]
    assert "TPU_ACCELERATOR_TYPE" not in results[True].stderr
    assert "TPU_ACCELERATOR_TYPE" in results[False].stderr  # what it spares every tool
