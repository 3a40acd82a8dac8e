"""The profiler of `python -m benchmarks.train_step --profile_dir`: a real trace's ops
summed per HLO instruction, GPU and CPU traces read from made-up planes (each kernel once;
CPU threads' overlapping ops splitting the wall time), op time by model layer and a
variant's time beyond its expected share of a baseline's."""

import jax
import jax.numpy as jnp

from benchmarks import profiling


def test_profile_sums_the_steps_ops_and_names_their_hlo(tmp_path):
    """A jitted matrix product + tanh: the profile's top op is the product's fusion (its
    HLO names a dot), and only instructions of the compiled HLO are counted."""
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
