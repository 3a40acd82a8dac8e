"""One train-step variant compiled and timed on a random batch: compile time, step times,
FLOPs (XLA's cost analysis), model FLOPs utilisation, XLA's memory estimate and the device's
peak memory."""

import os
import statistics
import time

import jax
import jax.extend
import numpy as np

from benchmarks import profiling, timing
from benchmarks import variants as variants_lib
from rspc_jax import parallel
from rspc_jax.data import specs as datasets
from rspc_jax.tools import memory_plan
from rspc_jax.training import host_memory, setup

# Dense peak FLOP/s per JAX device by device kind: (bfloat16, float32). float32 on NVIDIA
# GPUs is the TF32 tensor-core peak (XLA's default precision for f32 dots); TPUs have no
# separate float32 peak. v3 devices are single cores (half a chip); v4+ are whole chips.
PEAK_FLOPS = (
    ("H100", 989.4e12, 494.7e12),
    ("H200", 989.4e12, 494.7e12),
    ("A100", 312e12, 156e12),
    ("TPU v3", 61.5e12, None),
    ("TPU v4", 275e12, None),
    ("TPU v5 lite", 197e12, None),
    ("TPU v5e", 197e12, None),
    ("TPU v5p", 459e12, None),
    ("TPU v5", 459e12, None),
    ("TPU v6 lite", 918e12, None),
    ("TPU v6e", 918e12, None),
)


def peak_flops(device_kind: str, dtype: str):
    """The device's dense peak for `dtype` ('bfloat16' | 'float32'), or None if unknown."""
    for name, bf16, fp32 in PEAK_FLOPS:
        if name in device_kind:
            return bf16 if dtype == "bfloat16" else fp32
    return None


def _step_flops(lowered) -> float:
    """FLOPs of one step on one device, from XLA's cost analysis of the step as lowered
    (the step is a shard_map, so its body is one device's program). Not the compiled
    step's analysis: on GPUs that misses the products handed to cuBLAS, most of a
    transformer's FLOPs."""
    analysis = lowered.cost_analysis()
    if analysis is None:  # PJRT plugin backends (GPUs) have no analysis of a lowered step
        analysis = host_cost_analysis(lowered)
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0]
    return float(analysis.get("flops", 0.0)) if analysis else 0.0


def host_cost_analysis(lowered) -> dict:
    """XLA's CPU cost model applied to the lowered step of any backend: the count is of the
    program before any backend's passes, so the host's model reads the same module (custom
    calls, e.g. cuDNN's attention kernel, count no FLOPs). jax exposes this only privately."""
    from jax._src.lib import _jax  # private: see the docstring

    module = lowered.compiler_ir("hlo").as_hlo_module()
    return _jax.hlo_module_cost_analysis(jax.extend.backend.get_backend("cpu"), module)


def _train_parts(config, spec, mesh):
    model = setup.build_model(config, spec.num_classes)
    return setup.build(config, model, spec, mesh, steps_per_epoch=1000, total_steps=1000)


def compile_step(config, spec, batch):
    """Builds `config`'s train state and compiles its step (ahead of time) for `batch`: the
    state, the step's batch argument (with config.steps_per_call > 1, that many copies of
    the global batch, for one call of that many steps), the compiled step, the seconds
    spent lowering and compiling, and one step's FLOPs."""
    mesh = parallel.create_mesh()
    parts = _train_parts(config, spec, mesh)
    state = parts.init(jax.random.PRNGKey(config.seed))
    global_batch = parallel.to_global(batch, mesh)
    step, batches = parts.train_step, global_batch
    if config.steps_per_call > 1:
        step, batches = parts.train_steps, (global_batch,) * config.steps_per_call
    start = time.perf_counter()
    lowered = step.lower(state, batches)
    compiled = lowered.compile()
    compile_sec = time.perf_counter() - start
    if config.scan_blocks or config.grad_accum_steps > 1 or config.steps_per_call > 1:
        # XLA counts a loop body once, not once per block, micro-batch or step: count one
        # step without these loops (the same math).
        unrolled = config.copy_and_resolve_references()
        unrolled.scan_blocks, unrolled.grad_accum_steps, unrolled.steps_per_call = False, 1, 1
        flops = _step_flops(
            _train_parts(unrolled, spec, mesh).train_step.lower(state, global_batch)
        )
    else:
        flops = _step_flops(lowered)
    return state, batches, compiled, compile_sec, flops


def time_step(
    config, spec, batch, steps: int, profile_dir: str = "", keep_timer: bool = False
) -> dict:
    """Compiles (ahead of time) and times `steps` train steps of `config` on `batch`; with
    `profile_dir`, then traces 2 more steps there and adds the top ops ('top_ops') and their
    time by model layer ('scopes'); with `keep_timer`, adds 'time_steps' (n -> seconds of n more steps, and cores busy), which
    keeps the compiled step and its state alive for later rounds. With
    config.steps_per_call > 1 each timed call runs that many steps, and the times are per
    step."""
    state, batches, compiled, compile_sec, flops = compile_step(config, spec, batch)
    # XLA's memory analysis allocates (tens of MiB a call on CPU), so it runs before the memory it freed goes back, as in the training loop, not after the
    # steps, where it raised the process's peak.
    temp_bytes = host_memory.host_temporary_bytes(compiled)
    step_bytes = memory_plan.compiled_bytes(compiled)
    host_memory.release_freed_memory()  # as the training loop does before its first step
    per_call = config.steps_per_call

    def call():
        """One call, blocked as the training loop's on CPU; the state carries over."""
        nonlocal state
        with host_memory.temporaries_returned(temp_bytes):
            state, metrics = compiled(state, batches)
            jax.block_until_ready(metrics)

    def time_steps(count: int) -> tuple[list[float], float]:
        """Seconds per step of each of `count` calls, and the cores they kept busy."""
        times, cores_busy = timing.time_calls(call, count)
        return [t / per_call for t in times], cores_busy

    call()  # warm-up: first-run allocations
    times, cores_busy = time_steps(steps)
    median = statistics.median(times)
    top = scopes = None
    if profile_dir:
        trace_file = profiling.trace(call, 2, profile_dir)
        hlo = compiled.as_text()
        with open(os.path.join(profile_dir, "step.hlo.txt"), "w") as f:
            f.write(hlo)  # the optimised HLO the trace's op names refer to
        top = profiling.top_ops(trace_file, hlo, steps=2 * per_call, count=None)
        scopes = profiling.by_scope(top, hlo)
    peak = peak_flops(jax.devices()[0].device_kind, config.compute_dtype or "float32")
    stats = jax.devices()[0].memory_stats() or {}
    return dict(
        compile_sec=compile_sec,
        median_sec=median,
        images_per_sec=config.batch_size / median,
        flops=flops,
        mfu=flops / median / peak if peak and flops else None,
        step_bytes=step_bytes,
        peak_bytes=stats.get("peak_bytes_in_use"),
        top_ops=top,
        scopes=scopes,
        cores_busy=cores_busy,
        steps_per_call=per_call,
        **({"time_steps": time_steps} if keep_timer else {}),
    )


def random_batch(config):
    """The config's dataset spec and one random batch of this process's share of it."""
    setup.validate_config(config)
    spec = datasets.dataset_spec(config.dataset)
    rng = np.random.default_rng(0)
    local = config.batch_size // jax.process_count()
    batch = {
        "image": rng.standard_normal((local, config.image_size, config.image_size, 3), np.float32),
        "label": rng.integers(0, spec.num_classes, local).astype(np.int32),
    }
    return spec, batch


def time_variants(
    config, variants: list[str], steps: int, profile_dir: str = "", keep_timers: bool = False
) -> dict:
    """variant -> `time_step`'s result for every variant of `config`, each on its own random
    batch and with its implementation choices (with `profile_dir`, traced into
    <profile_dir>/<variant>); `keep_timers` keeps each variant's 'time_steps' for the
    interleaved rounds of `side_by_side`."""
    results = {}
    for name in variants:
        variant = variants_lib.variant_config(config, name)
        spec, batch = random_batch(variant)
        with variants_lib.implementations(name):
            results[name] = time_step(
                variant,
                spec,
                batch,
                steps,
                profile_dir=os.path.join(profile_dir, name) if profile_dir else "",
                keep_timer=keep_timers,
            )
    return results


def compile_variants(config, variants: list[str]) -> dict:
    """variant -> its compile seconds, FLOPs and XLA's memory estimate ('step_bytes'),
    running no step: a quick look before a long compile-and-run, and the way to fill JAX's
    persistent compilation cache (JAX_COMPILATION_CACHE_DIR) for a timed run, e.g. several
    configs compiled at once on a many-core host, then timed one by one."""
    results = {}
    for name in variants:
        variant = variants_lib.variant_config(config, name)
        with variants_lib.implementations(name):
            _, _, compiled, compile_sec, flops = compile_step(variant, *random_batch(variant))
        results[name] = dict(
            compile_sec=compile_sec, flops=flops, step_bytes=memory_plan.compiled_bytes(compiled)
        )
    return results
