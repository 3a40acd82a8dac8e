"""The benchmark script runs at smoke size and prints both steps, their ratio, XLA's FLOP
count (RSPC's step does at least twice the plain step's work) and memory estimate."""

import json
import os
import re
import sys

import jax
import pytest

from rspc_jax.models import ops
from rspc_jax.tools import benchmark, profiling
from rspc_jax.training import host_memory
from tests.conftest import REPO, load_config, run_module_without_tensorflow, run_python

_ROW = (
    r"^{}\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+\d+\.\d+\s+\d+\.\d+\s+(\S+)\s+(\S+)\s+(\d+)\s+(\S+)"
    r"\s+(\d+\.\d+)$"
)


_SIDE_ROW = r"^{}\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\S+)\s+(\d+)\s+(\d+\.\d+)$"


def _benchmark(*extra, config="configs/demo.py:smoke"):
    result = run_python(
        [
            "-m",
            "rspc_jax.benchmark",
            f"--config={config}",
            "--steps=2",
            *extra,
        ],
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_benchmark_prints_plain_rspc_ratio_flops_and_memory():
    """With plain_2x (the plain step on twice the batch: the images RSPC's forward puts
    through the classifier) the table also gives RSPC's cost beyond doubling the batch."""
    out = _benchmark("--batch=8", "--variants=plain,plain_2x,rspc")
    plain = re.search(_ROW.format("plain"), out, re.M)
    doubled = re.search(_ROW.format("plain_2x"), out, re.M)
    rspc = re.search(_ROW.format("rspc"), out, re.M)
    assert plain and doubled and rspc, out
    ratio = float(re.search(r"ratio rspc/plain step time: (\d+\.\d+)", out).group(1))
    assert ratio > 0
    beyond = re.search(r"ratio rspc/plain_2x step time: (\d+\.\d+)", out)
    assert beyond and float(beyond.group(1)) > 0, out
    doubling = re.search(r"ratio plain_2x/plain step time: (\d+\.\d+)", out)
    assert doubling, out
    medians = float(doubled.group(2)) / float(plain.group(2))
    assert float(doubling.group(1)) == pytest.approx(medians, rel=0.05, abs=0.01)
    assert plain.group(5) == "n/a"  # no MFU on CPU: no known peak
    plain_flops, doubled_flops = float(plain.group(4)), float(doubled.group(4))
    rspc_flops = float(rspc.group(4))
    assert plain_flops > 0 and rspc_flops >= 1.9 * plain_flops
    assert 1.9 * plain_flops <= doubled_flops <= 2.1 * plain_flops
    assert rspc_flops > doubled_flops  # the corruption model's work on top
    # images/s counts each step's own batch: 16 images for plain_2x
    images = float(doubled.group(3)) * float(doubled.group(2))  # the median is rounded
    assert abs(images / 16 - 1) < 0.02, out
    assert int(rspc.group(6)) > 0
    for row in (plain, doubled, rspc):  # cores busy: CPU time over wall time
        assert 0 < float(row.group(8)) <= os.cpu_count() + 0.1


def test_compile_only_prints_compile_times_without_running_and_fills_the_cache(tmp_path):
    """--compile_only runs no step; with JAX's persistent cache set, a later timed run of the
    same config loads its compiled step from there."""
    cache = tmp_path / "cache"
    env = {
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
    }
    args = ["-m", "rspc_jax.benchmark", "--config=configs/demo.py:smoke", "--batch=8"]
    result = run_python([*args, "--compile_only"], timeout=300, env_extra=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "compiled only" in result.stdout and "median" not in result.stdout
    for name in ("plain", "rspc"):
        row = re.search(rf"^{name}\s+(\d+\.\d+)\s+(\S+)\s+(\d+)$", result.stdout, re.M)
        assert row, result.stdout
        assert float(row.group(2)) > 0 and int(row.group(3)) > 0
    steps = {path.name for path in cache.iterdir() if "train_step" in path.name}
    assert len(steps) == 2, sorted(path.name for path in cache.iterdir())
    timed = run_python([*args, "--steps=1"], timeout=300, env_extra=env)
    assert timed.returncode == 0, timed.stderr[-3000:]
    assert {path.name for path in cache.iterdir() if "train_step" in path.name} == steps


def test_modes_that_run_no_step_refuse_the_flags_of_timed_runs():
    """--compile_only and --memory would silently ignore a reference or a profile."""
    result = run_python(
        [
            "-m",
            "rspc_jax.benchmark",
            "--config=configs/demo.py:smoke",
            "--compile_only",
            "--compare_timm",
            "--profile_dir=/tmp/unused",
        ],
        timeout=120,
    )
    assert result.returncode != 0
    assert (
        "--compile_only runs no step, so --compare_timm, --profile_dir would do nothing: drop "
        "them, or drop --compile_only to time the steps"
    ) in result.stderr


def test_timm_step_refuses_a_device_torch_cannot_use():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU, so --device=cuda is valid")
    result = run_python(
        ["-m", "rspc_jax.tools.timm_step", "--model=deit_tiny_patch16_224", "--device=cuda"],
        timeout=120,
    )
    assert result.returncode != 0
    assert "--device=cuda is not a device torch can run on here" in result.stderr
    assert "pass --device=cpu" in result.stderr


def test_timing_a_step_never_loads_tensorflow():
    """TF holds 0.6 GB of host memory; the step-only tools must not pay it (data is random;
    the memory planner is checked the same way in test_memory_plan)."""
    result = run_module_without_tensorflow(
        "rspc_jax.benchmark", ["--config=configs/demo.py:smoke", "--steps=1"], timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rspc" in result.stdout


def test_peak_flops_by_device_kind_and_dtype():
    assert benchmark.peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4e12
    assert benchmark.peak_flops("NVIDIA H200", "float32") == 494.7e12
    assert benchmark.peak_flops("TPU v4", "bfloat16") == 275e12
    assert benchmark.peak_flops("TPU v3", "float32") is None
    assert benchmark.peak_flops("cpu", "bfloat16") is None


def test_flops_of_a_lowered_step_without_the_backends_analysis_come_from_the_host():
    """GPU plugins have no cost analysis of a lowered step (MFU read n/a on an H200): the
    host's XLA cost model of the same module gives the count the CPU backend gives."""
    import jax
    import jax.numpy as jnp

    lowered = jax.jit(lambda a, b: jnp.tanh(a @ b).sum()).lower(
        jnp.ones((64, 32)), jnp.ones((32, 16))
    )
    assert benchmark.host_cost_analysis(lowered)["flops"] == lowered.cost_analysis()["flops"]
    assert lowered.cost_analysis()["flops"] >= 2 * 64 * 32 * 16


def test_benchmark_counts_every_scanned_block_micro_batch_and_step():
    """XLA's cost analysis counts a loop body once; the scanned model, the accumulated
    step and a call of several steps (timed per step) do the same work per step."""
    outs = (
        _benchmark("--batch=8", "--variants=plain"),
        _benchmark("--batch=8", "--variants=plain", "--config.scan_blocks=True"),
        _benchmark("--batch=8", "--variants=plain", "--config.grad_accum_steps=2"),
        _benchmark("--batch=8", "--variants=plain", "--config.steps_per_call=3"),
    )
    rows = [re.search(_ROW.format("plain"), out, re.M).group(4) for out in outs]
    assert rows[0] == rows[1] == rows[2] == rows[3]
    assert "2 timed calls of 3 steps" in outs[3]


def test_profile_sums_the_steps_ops_and_names_their_hlo(tmp_path):
    """A jitted matrix product + tanh: the profile's top op is the product's fusion (its
    HLO names a dot), and only instructions of the compiled HLO are counted."""
    import jax
    import jax.numpy as jnp

    step = jax.jit(lambda x: jnp.tanh(x @ x).sum())
    x = jnp.ones((512, 512))
    compiled = step.lower(x).compile()
    compiled(x).block_until_ready()
    trace = profiling.trace(lambda: compiled(x).block_until_ready(), 3, str(tmp_path))
    rows = profiling.top_ops(trace, compiled.as_text(), steps=3)
    described = profiling.describe_ops(compiled.as_text())
    assert rows and all(r["name"] in described for r in rows)
    assert "dot" in rows[0]["what"] or rows[0]["what"].startswith("dot"), rows
    assert abs(sum(r["share"] for r in rows) - 1.0) < 1e-6  # every op of the step is listed
    assert rows[0]["ms_per_step"] > 0


def test_gpu_traces_count_every_kernel_once_under_the_instruction_that_ran_it():
    """A GPU trace times kernels on its streams, named after their fusion ('.' -> '_', one
    kernel for deduplicated copies) or, for library kernels, by an "hlo_op" stat; the host's
    launch events repeat instruction names and must not count twice. On CPU the host
    threads' events are the ops."""
    from types import SimpleNamespace as Namespace

    hlo = """HloModule m

%fused_computation (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  ROOT %add.2 = f32[4]{0} add(%param_0, %param_0)
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %loop_add_fusion.3 = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_computation
  %loop_add_fusion.7 = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_computation, metadata={deduplicated_name="loop_add_fusion.3"}
  ROOT %custom-call.1 = f32[4]{0} custom-call(%loop_add_fusion.7), custom_call_target="__cublas$gemm"
}
"""

    def event(name, ns, start=0, **stats):
        return Namespace(name=name, start_ns=start, duration_ns=ns, stats=list(stats.items()))

    def plane(name, *lines):
        return Namespace(name=name, lines=[Namespace(name=n, events=e) for n, e in lines])

    gpu = [
        plane("/host:CPU", ("launches", [event("loop_add_fusion.3", 10**9)])),
        plane(
            "/device:GPU:0",
            (
                "Stream #14(Compute)",
                [
                    event("loop_add_fusion_3", 2 * 10**6),
                    event("loop_add_fusion_3", 2 * 10**6),
                    event("nvjet_sm90_gemm", 4 * 10**6, hlo_op="custom-call.1"),
                    event("nvjet_sm90_gemm", 1 * 10**6, hlo_op="command_buffer_5"),
                ],
            ),
        ),
    ]
    rows = {r["name"]: r for r in profiling.sum_ops(gpu, hlo, steps=1, count=None)}
    assert {name: r["ms_per_step"] for name, r in rows.items()} == {
        "loop_add_fusion.3": 4.0,
        "custom-call.1": 4.0,
        "nvjet_sm90_gemm": 1.0,
    }
    assert (
        rows["loop_add_fusion.3"]["what"] == "fusion: add"
        and rows["loop_add_fusion.3"]["calls_per_step"] == 2
    )
    assert rows["nvjet_sm90_gemm"]["what"] == "library kernel"
    cpu = [
        plane("/host:CPU", ("tf_XLAEigen", [event("loop_add_fusion.3", 10**6), event("main", 1)]))
    ]
    assert [r["name"] for r in profiling.sum_ops(cpu, hlo, steps=1)] == ["loop_add_fusion.3"]


def test_cpu_op_times_split_the_wall_time_among_the_ops_running_at_once():
    """XLA:CPU runs ops on several threads: one op may run on two threads at once (a matrix
    product split in two) and two ops may overlap (independent ops). Each op's time is its
    share of the wall time: its events merged over threads, each instant split evenly among
    the ops running then, so the rows add up to the time some op ran and none counts twice."""
    from types import SimpleNamespace as Namespace

    hlo = """HloModule m

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %add.1 = f32[4]{0} add(%x, %x)
  %multiply.2 = f32[4]{0} multiply(%x, %x)
  ROOT %dot.3 = f32[4]{0} dot(%add.1, %multiply.2)
}
"""
    ms = 10**6

    def event(name, start_ms, end_ms):
        return Namespace(name=name, start_ns=start_ms * ms, duration_ns=(end_ms - start_ms) * ms)

    threads = [
        ("tf_XLAEigen/1", [event("add.1", 0, 10), event("dot.3", 20, 30)]),
        ("tf_XLAEigen/2", [event("multiply.2", 5, 15), event("dot.3", 20, 29)]),
    ]
    planes = [Namespace(name="/host:CPU", lines=[Namespace(name=n, events=e) for n, e in threads])]
    rows = {r["name"]: r for r in profiling.sum_ops(planes, hlo, steps=1, count=None)}
    assert {n: r["ms_per_step"] for n, r in rows.items()} == {
        "add.1": 7.5,
        "multiply.2": 7.5,
        "dot.3": 10.0,
    }
    assert rows["dot.3"]["calls_per_step"] == 1  # one call, on two threads
    assert abs(sum(r["share"] for r in rows.values()) - 1.0) < 1e-9


def test_op_time_by_layer_and_rspcs_time_beyond_twice_plain():
    """Ops are summed by the layer their op_name metadata names (forward or backward, block
    indices folded; optimizer ops outside the model), and RSPC's excess is its time beyond
    twice the plain step's per layer."""
    assert (
        profiling.scope_of(
            "jit(_per_device_train_step)/transpose(jvp(RVT))/transformers_0/blocks_3/mlp/"
            "dwconv/reduce_sum"
        )
        == "backward RVT/transformers_0/blocks_*/mlp/dwconv"
    )
    assert (
        profiling.scope_of("jit(_per_device_train_step)/jvp(ViT)/blocks_11/attn/qkv/dot_general")
        == "forward ViT/blocks_*/attn/qkv"
    )
    assert (
        profiling.scope_of("jit(_per_device_train_step)/transpose(jvp())/split")
        == "backward (model input)"
    )
    assert (
        profiling.scope_of("jit(_per_device_train_step)/jvp(vmap(jit(_uniform)))/add")
        == "forward vmap(jit(_uniform))"
    )
    assert profiling.scope_of("jit(_per_device_train_step)/add") == "outside the model: add"
    assert (
        profiling.scope_of(
            "jit(_per_device_train_step)/transpose(jvp(RVT))/patch_embed/proj_0/"
            "transpose(transpose(jvp(RVT)))/patch_embed/proj_0/dot_general"
        )
        == "backward RVT/patch_embed/proj_0"
    )
    assert (
        profiling.scope_of("jit(f)/jvp(RVT)/transformers_0/blocks_2/mlp/dwconv/jit(_pad)/pad")
        == "forward RVT/transformers_0/blocks_*/mlp/dwconv"
    )

    def op(name, op_name):
        return f'  %{name} = f32[4]{{0}} add(%x, %x), metadata={{op_name="{op_name}"}}'

    hlo = "\n".join(
        [
            "ENTRY %main (x: f32[4]) -> f32[4] {",
            "  %x = f32[4]{0} parameter(0)",
            op("add.1", "jit(f)/jvp(ViT)/blocks_0/mlp/fc1/dot_general"),
            op("add.2", "jit(f)/jvp(ViT)/blocks_1/mlp/fc1/add"),
            op("add.3", "jit(f)/transpose(jvp(ViT))/blocks_0/mlp/fc1/dot_general"),
            "  ROOT %add.4 = f32[4]{0} add(%x, %x)",
            "}",
        ]
    )

    def rows(**ms):
        return [
            dict(name=name.replace("_", "."), ms_per_step=t, calls_per_step=1.0)
            for name, t in ms.items()
        ]

    plain = profiling.by_scope(rows(add_1=1.0, add_2=2.0, add_3=4.0, add_4=0.5), hlo)
    assert plain == {
        "forward ViT/blocks_*/mlp/fc1": dict(ms_per_step=3.0, calls=2.0),
        "backward ViT/blocks_*/mlp/fc1": dict(ms_per_step=4.0, calls=1.0),
        "outside the model: ?": dict(ms_per_step=0.5, calls=1.0),
    }
    rspc = profiling.by_scope(rows(add_1=2.0, add_2=4.0, add_3=11.0, add_4=0.5), hlo)
    beyond = profiling.excess(rspc, plain, 2.0)
    assert [(r["scope"], r["excess_ms"]) for r in beyond] == [
        ("backward ViT/blocks_*/mlp/fc1", 3.0),
        ("forward ViT/blocks_*/mlp/fc1", 0.0),
        ("outside the model: ?", -0.5),
    ]


def test_step_comparisons_are_those_whose_two_variants_ran():
    """What the method costs beyond the doubled batch and what doubling the batch costs
    beyond twice the work are each compared only where both steps were run."""
    assert benchmark.step_comparisons(["plain", "rspc"]) == [("rspc", "plain", 2.0)]
    assert benchmark.step_comparisons(["plain_2x", "plain"]) == [("plain_2x", "plain", 2.0)]
    assert benchmark.step_comparisons({"rspc": 1.0, "plain_2x": 2.0, "plain": 0.5}) == [
        ("rspc", "plain", 2.0),
        ("rspc", "plain_2x", 1.0),
        ("plain_2x", "plain", 2.0),
    ]
    assert benchmark.step_comparisons(["rspc", "fgsm_at"]) == []


def test_describe_ops_reads_fusions_and_plain_instructions():
    hlo = """HloModule m

%fused_computation (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  %exponential.1 = f32[4]{0} exponential(%param_0)
  ROOT %add.2 = f32[4]{0} add(%exponential.1, %exponential.1)
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %dot.3 = f32[4]{0} dot(%x, %x), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  ROOT %loop_fusion = f32[4]{0} fusion(%dot.3), kind=kLoop, calls=%fused_computation
}
"""
    described = profiling.describe_ops(hlo)
    assert described["dot.3"] == "dot"
    assert described["loop_fusion"] in ("fusion: exponential, add", "fusion: add, exponential")


def test_compare_timm_alternates_rounds_and_prints_the_ratio():
    """timm's step (a fresh process per round) alternates with ours; the ratio is of the
    medians over all rounds."""
    out = _benchmark(
        "--config.model_name=deit_tiny_patch16_224",
        "--config.image_size=32",
        "--batch=2",
        "--rounds=2",
        "--variants=plain",
        "--compare_timm",
        config="configs/deit_s.py",
    )
    assert "2 interleaved rounds of 2 steps each" in out, out
    timm = re.search(_SIDE_ROW.format("timm"), out, re.M)
    plain = re.search(_SIDE_ROW.format("plain"), out, re.M)
    assert timm and plain, out
    assert float(timm.group(2)) == 1.0 and plain.group(3) == "timm"
    ratio = float(plain.group(1)) / float(timm.group(1))
    assert abs(float(plain.group(2)) - ratio) < 0.01
    for match in (timm, plain):
        assert int(match.group(4)) > 0 and 0 < float(match.group(5)) <= os.cpu_count() + 0.1


def test_compare_command_pairs_each_variant_with_its_reference():
    """A reference step of any framework: a command printing a JSON record of step times."""
    fake = "python -c \"import json; print(json.dumps({'times': [%s] * {steps}}))\""
    out = _benchmark(
        "--batch=8",
        "--rounds=2",
        f"--compare_command=plain={fake % 0.5}",
        f"--compare_command=rspc={fake % 4.0}",
    )
    assert "2 interleaved rounds of 2 steps each" in out, out
    rows = {
        name: re.search(
            _SIDE_ROW.replace(r"(\d+)\s+(\d+\.\d+)$", r"(\S+)\s+(\S+)$").format(name), out, re.M
        )
        for name in ("ref:plain", "ref:rspc", "plain", "rspc")
    }
    assert all(rows.values()), out
    assert float(rows["ref:plain"].group(1)) == 0.5 and float(rows["ref:rspc"].group(1)) == 4.0
    for name, seconds in (("plain", 0.5), ("rspc", 4.0)):
        assert rows[name].group(3) == f"ref:{name}"
        assert abs(float(rows[name].group(2)) - float(rows[name].group(1)) / seconds) < 0.01


def test_compare_command_refuses_unknown_variants_and_bad_records():
    result = run_python(
        [
            "-m",
            "rspc_jax.benchmark",
            "--config=configs/demo.py:smoke",
            "--variants=plain",
            "--compare_command=rspc=true",
        ],
        timeout=120,
    )
    assert result.returncode != 0
    assert "write VARIANT=COMMAND with VARIANT one of --variants (plain)" in result.stderr
    assert "Compil" not in result.stderr  # refused before anything is built
    result = run_python(
        [
            "-m",
            "rspc_jax.benchmark",
            "--config=configs/demo.py:smoke",
            "--steps=1",
            "--batch=8",
            "--variants=plain",
            "--compare_command=plain=echo not json",
        ],
        timeout=300,
    )
    assert result.returncode != 0
    assert "must print, as its last line, a JSON record with 'times'" in result.stderr


def test_timm_step_mixes_batches_as_the_config_does():
    """The reference does the Mixup/CutMix our step does (deit_s: 0.8 / 1.0), with the
    config's settings, so neither side is timed for work the other skips."""
    _, config = load_config(REPO / "configs" / "deit_s.py")
    command = benchmark.timm_command(config, steps=1)
    assert "--mixup_alpha=0.8" in command and "--cutmix_alpha=1.0" in command
    tiny = ["--model=deit_tiny_patch16_224", "--image_size=32", "--batch=2", "--steps=2"]
    records = {}
    for alphas in ([], ["--mixup_alpha=0.8", "--cutmix_alpha=1.0"]):
        result = run_python(["-m", "rspc_jax.tools.timm_step", *tiny, *alphas], timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        records[bool(alphas)] = json.loads(result.stdout.strip().splitlines()[-1])
    assert records[False]["mixup"] is False and records[True]["mixup"] is True
    assert len(records[True]["times"]) == 2


def test_timm_reference_runs_at_our_precision_on_our_device():
    """bfloat16 configs time timm under bfloat16 autocast; on CPU it runs on the CPU and
    reports no device memory."""
    _, config = load_config(REPO / "configs" / "deit_s.py")
    assert {"--device=cpu", "--bfloat16=False"} <= set(benchmark.timm_command(config, steps=1))
    config.compute_dtype = "bfloat16"
    assert "--bfloat16=True" in benchmark.timm_command(config, steps=1)
    tiny = ["--model=deit_tiny_patch16_224", "--image_size=32", "--batch=2", "--steps=1"]
    result = run_python(
        ["-m", "rspc_jax.tools.timm_step", *tiny, "--device=cpu", "--bfloat16"], timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(record["times"]) == 1 and record["peak_device_bytes"] is None


def test_compare_timm_refuses_an_odd_batch_to_mix_before_compiling():
    _, config = load_config(REPO / "configs" / "deit_s.py")
    config.batch_size = 7
    with pytest.raises(SystemExit, match="needs an even batch \\(got 7\\): pass an even --batch"):
        benchmark.timm_command(config, steps=1)
    config.mixup.mixup_alpha = config.mixup.cutmix_alpha = 0.0
    assert "--batch=7" in benchmark.timm_command(config, steps=1)


def test_compare_timm_refuses_a_model_timm_does_not_have():
    result = run_python(["-m", "rspc_jax.tools.timm_step", "--model=rvt_tiny_plus"], timeout=120)
    assert result.returncode != 0
    assert "rvt_tiny_plus is not a timm model" in result.stderr


def test_layer_benchmark_times_each_block_part_beside_timm():
    result = run_python(
        [
            "-m",
            "rspc_jax.tools.layer_benchmark",
            "--batch=2",
            "--tokens=17",
            "--width=64",
            "--heads=2",
            "--model=",
            "--steps=2",
            "--rounds=2",
        ],
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "medians of 2 alternating rounds of 2 steps" in result.stdout
    for part in ("layernorm", "attention", "mlp", "block"):
        row = re.search(rf"^{part}\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)$", result.stdout, re.M)
        assert row, result.stdout
        ours, theirs, ratio = (float(value) for value in row.groups())
        assert ours > 0 and theirs > 0 and abs(ratio - ours / theirs) < 0.01 + 0.01 * ratio


def test_benchmarks_refuse_fewer_than_one_step_or_round():
    for module in ("rspc_jax.benchmark", "rspc_jax.tools.layer_benchmark"):
        for flag in ("--steps=0", "--rounds=0"):
            extra = ["--config=configs/demo.py:smoke"] if module == "rspc_jax.benchmark" else []
            result = run_python(["-m", module, *extra, flag], timeout=120)
            assert result.returncode != 0
            assert f"flag {flag}: 0 is not a positive integer" in result.stderr, result.stderr


def test_side_by_side_rounds_start_from_released_memory(monkeypatch, capsys):
    """What the table's code freed after its steps is returned to the OS before the rounds'
    steps, so our peak beside the reference's is the step's own, as in the table."""
    events = []
    monkeypatch.setattr(host_memory, "release_freed_memory", lambda: events.append("release"))

    def time_steps(count):
        events.append("steps")
        return [0.1] * count, 1.0

    reference = [sys.executable, "-c", "import json; print(json.dumps({'times': [0.2]}))"]
    medians = benchmark.compare_side_by_side(
        {"plain": {"time_steps": time_steps}}, {"plain": ("ref", reference)}, steps=2, rounds=2
    )
    assert events == ["release"] + ["steps"] * 4  # a warm-up and 2 steps per round
    assert medians == {"ref": 0.2, "plain": 0.1}
    assert "2 interleaved rounds of 2 steps each" in capsys.readouterr().out


def test_side_by_side_prints_how_far_single_rounds_strayed(capsys):
    """Each round's median against the reference's in the same round: the lowest and the
    highest, so a table's ratio comes with the drift that interleaving did not remove."""
    round_times = iter([0.1, 0.1, 0.3, 0.3])  # a warm-up and a timed call per round

    def time_steps(count):
        return [next(round_times)] * count, 1.0

    reference = [sys.executable, "-c", "import json; print(json.dumps({'times': [0.2]}))"]
    medians = benchmark.compare_side_by_side(
        {"plain": {"time_steps": time_steps}}, {"plain": ("ref", reference)}, steps=1, rounds=2
    )
    assert medians == {"ref": 0.2, "plain": 0.2}
    out = capsys.readouterr().out
    assert "x reference in single rounds (lowest-highest): plain 0.50-1.50" in out, out
    benchmark.compare_side_by_side(
        {"plain": {"time_steps": lambda count: ([0.1] * count, 1.0)}},
        {"plain": ("ref", reference)},
        steps=1,
        rounds=1,
    )
    assert "single rounds" not in capsys.readouterr().out  # one round has no spread


def test_side_by_side_shows_device_memory_when_a_reference_reports_it(capsys):
    """A GPU reference reports its allocator's peak; the table then gets a device column."""
    record = "{'times': [0.2], 'peak_device_bytes': 3 * 2**20}"
    reference = [sys.executable, "-c", f"import json; print(json.dumps({record}))"]
    benchmark.compare_side_by_side(
        {"plain": {"time_steps": lambda count: ([0.1] * count, 1.0)}},
        {"plain": ("ref", reference)},
        steps=1,
        rounds=1,
    )
    out = capsys.readouterr().out
    assert "device MiB" in out
    assert re.search(r"^ref\s.*\s3$", out, re.M), out
    assert re.search(r"^plain\s.*\s(n/a|\d+)$", out, re.M), out


def test_pytorch_references_use_the_cores_the_process_may_run_on():
    """Under `taskset -c 0` PyTorch gets one thread, not one per core of the machine (which
    would time-share the one core and slow the reference down)."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("this platform has no CPU affinity masks")
    script = (
        "import os; from rspc_jax.tools import timing; "
        "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); print(timing.usable_cores())"
    )
    result = run_python(["-c", script], timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["1"]


def test_interleave_alternates_our_variants_without_a_reference():
    """--interleave: our variants alone, alternated for --rounds rounds, each against the
    first variant, and RSPC's ratios from the medians over all rounds."""
    out = _benchmark("--batch=8", "--steps=1", "--rounds=2", "--interleave")
    assert "our variants alone, 2 interleaved rounds of 1 steps each" in out, out
    row = _SIDE_ROW.replace(r"(\d+)\s+(\d+\.\d+)$", r"(\S+)\s+(\S+)$")
    plain = re.search(row.format("plain"), out, re.M)
    rspc = re.search(row.format("rspc"), out, re.M)
    assert plain and rspc, out
    assert float(plain.group(2)) == 1.0 and plain.group(3) == rspc.group(3) == "plain"
    ratio = float(rspc.group(1)) / float(plain.group(1))  # of medians rounded to 0.1 ms
    assert abs(float(rspc.group(2)) / ratio - 1) < 0.1, out
    over_rounds = re.search(r"ratio rspc/plain step time over the rounds: (\d+\.\d+)", out)
    assert over_rounds and over_rounds.group(1) == rspc.group(2), out
    assert "ref:" not in out


def test_unknown_variants_are_refused_before_anything_compiles():
    for extra in ([], ["--compile_only"]):
        result = run_python(
            [
                "-m",
                "rspc_jax.benchmark",
                "--config=configs/demo.py:smoke",
                "--variants=plain,plain_3x",
                "--steps=1",
                *extra,
            ],
            timeout=120,
        )
        assert result.returncode != 0
        assert "unknown step variant 'plain_3x'" in result.stderr, result.stderr[-2000:]
        assert "plain, rspc, plain_2x" in result.stderr and "trades1" in result.stderr
        assert "median" not in result.stdout  # nothing timed


def test_a_variant_s_switches_hold_while_its_step_compiles():
    """'rspc@RSPC_JAX_CPU_PRODUCTS=xla': the RSPC step's config, with the switch set only
    inside `variant_switches` (where the step is traced and compiled)."""
    name = "rspc@RSPC_JAX_CPU_PRODUCTS=xla@RSPC_JAX_CPU_SCHEDULE=xla"
    _, config = load_config(REPO / "configs" / "demo.py", "smoke")
    assert benchmark.variant_config(config, name).rspc.enabled
    with ops.cpu_products("auto"), ops.cpu_schedule("auto"):
        default = ops.compiler_options()
        with benchmark.variant_switches(name):
            inside = ops.compiler_options()
        assert ops.compiler_options() == default
    assert inside is None
    if jax.default_backend() == "cpu":
        assert default["xla_cpu_use_onednn"] and default["xla_cpu_scheduler_type"]


def test_switch_variants_compile_side_by_side_and_bad_ones_are_refused_first():
    args = ["-m", "rspc_jax.benchmark", "--config=configs/demo.py:smoke", "--batch=8"]
    ab = "plain,plain@RSPC_JAX_WINDOW_OPS=xla"
    result = run_python([*args, f"--variants={ab}", "--compile_only"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ab.split(","):
        assert re.search(rf"^{name}\s+\d+\.\d+\s+\S+\s+\d+$", result.stdout, re.M), result.stdout
    for variant, message in (
        ("rspc@RSPC_JAX_NOPE=xla", "'RSPC_JAX_NOPE' is not a switch of rspc_jax.models.ops"),
        ("rspc@RSPC_JAX_CPU_PRODUCTS=fast", "choice 'fast' is not one of ('auto', 'xla')"),
    ):
        result = run_python([*args, f"--variants=plain,{variant}", "--steps=1"], timeout=120)
        assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]
        assert "median" not in result.stdout
    result = run_python([*args, "--variants=rspc@RSPC_JAX_CPU_PRODUCTS=xla", "--memory"])
    assert result.returncode != 0 and "drop the @SWITCH=CHOICE parts" in result.stderr
