"""Speed of train-step variants of a config's model, measured in one run (the library of
`python -m rspc_jax.benchmark`, whose docstring says what the table holds)."""

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

import jax
import jax.extend
import numpy as np

from rspc_jax import ConfigError, parallel
from rspc_jax.data import specs as datasets
from rspc_jax.models import ops
from rspc_jax.tools import allocator, profiling, timing
from rspc_jax.training import ablations, host_memory, setup

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
    step's analysis: on GPUs that misses the products handed to cuBLAS (DeiT-S at batch
    128 on an H200: 413 GFLOP compiled, 3566 lowered; the analytic count is ~3.5 TFLOP)."""
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


def compiled_bytes(compiled) -> int:
    """XLA's estimate of one device's memory for the step: arguments, outputs and
    temporaries, less the donated buffers that outputs reuse."""
    m = compiled.memory_analysis()
    if m is None:
        return 0
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


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
    time by model layer ('scopes'); with
    `keep_timer`, adds 'time_steps' (n -> seconds of n more steps, and cores busy), which
    keeps the compiled step and its state alive for later rounds. With
    config.steps_per_call > 1 each timed call runs that many steps, and the times are per
    step."""
    state, batches, compiled, compile_sec, flops = compile_step(config, spec, batch)
    # XLA's memory analysis allocates (RVT-Ti*'s RSPC step: about 95 MiB a call on CPU), so
    # it runs before the memory it freed goes back, as in the training loop, not after the
    # steps, where it raised the process's peak.
    temp_bytes = host_memory.host_temporary_bytes(compiled)
    step_bytes = compiled_bytes(compiled)
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


def print_table(
    config, variants: list[str], steps: int, profile_dir: str = "", keep_timers: bool = False
) -> dict:
    """Times every variant of `config` on one random batch and prints the table (and, with
    `profile_dir`, each variant's top ops from a profiler trace in <profile_dir>/<variant>);
    `keep_timers` keeps each variant's 'time_steps' for `compare_side_by_side`'s rounds."""
    results = {}
    for name in variants:
        variant = variant_config(config, name)
        spec, batch = _random_batch(variant)
        with variant_switches(name):
            results[name] = time_step(
                variant,
                spec,
                batch,
                steps,
                profile_dir=os.path.join(profile_dir, name) if profile_dir else "",
                keep_timer=keep_timers,
            )
    print(
        f"model {config.model_name}, global batch {config.batch_size} clean images per step "
        f"(RSPC, TRADES and plain_2x put 2x through the classifier), "
        f"{jax.device_count()} x {jax.devices()[0].device_kind}, {steps} timed "
        + (f"calls of {config.steps_per_call} steps" if config.steps_per_call > 1 else "steps")
    )
    if jax.default_backend() == "cpu":  # where the allocator decides the step time
        print(f"memory allocator: {allocator.describe()}")
    first = next(iter(results))
    width = _name_width(results, 20)
    print(
        f"{'step':<{width}} {'compile s':>10} {'median step s':>14} {'images/s':>10} "
        f"{'steps/s':>8} {'x ' + first:>10} {'GFLOP/step':>11} {'MFU':>6} "
        f"{'XLA MiB':>8} {'peak MiB':>9} {'cores busy':>11}"
    )
    for name, r in results.items():
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        peak = f"{r['peak_bytes'] / 2**20:.0f}" if r["peak_bytes"] else "n/a"
        print(
            f"{name:<{width}} {r['compile_sec']:>10.2f} {r['median_sec']:>14.4f} "
            f"{r['images_per_sec']:>10.1f} {1 / r['median_sec']:>8.2f} "
            f"{r['median_sec'] / results[first]['median_sec']:>10.2f} "
            f"{r['flops'] / 1e9:>11.4g} {mfu:>6} {r['step_bytes'] / 2**20:>8.0f} {peak:>9} "
            f"{r['cores_busy']:>11.2f}"
        )
    print(
        "GFLOP/step: XLA's cost analysis of one device's step as lowered (custom calls such as "
        "cuDNN's attention count none); MFU against the device's "
        "dense peak for the compute dtype (n/a where unknown, e.g. CPU); XLA MiB: its "
        "estimate of one step's memory; peak MiB: the device allocator's peak (accelerators); "
        "cores busy: the process's CPU time over the wall time of the timed steps."
    )
    _print_step_ratios({name: r["median_sec"] for name, r in results.items()})
    for name, r in results.items():
        if r["top_ops"]:
            profiling.print_top_ops(f"{name}, by kind", profiling.by_kind(r["top_ops"]))
            profiling.print_top_ops(name, r["top_ops"][:10])
    for name, baseline, factor in step_comparisons(results):
        if results[name]["scopes"]:
            profiling.print_excess(
                f"{name} against {baseline}",
                results[name]["scopes"],
                results[baseline]["scopes"],
                factor,
            )
    return results


def _random_batch(config):
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


def print_compile_table(config, variants: list[str]) -> dict:
    """Compiles every variant of `config` without running it and prints the compile times,
    FLOPs and XLA's memory estimates: a quick look before a long compile-and-run, and the
    way to fill JAX's persistent compilation cache (JAX_COMPILATION_CACHE_DIR) for a timed
    run, e.g. several configs compiled at once on a many-core host, then timed one by one."""
    results = {}
    for name in variants:
        variant = variant_config(config, name)
        with variant_switches(name):
            _, _, compiled, compile_sec, flops = compile_step(variant, *_random_batch(variant))
        results[name] = dict(
            compile_sec=compile_sec, flops=flops, step_bytes=compiled_bytes(compiled)
        )
    print(
        f"model {config.model_name}, global batch {config.batch_size}, "
        f"{jax.device_count()} x {jax.devices()[0].device_kind}, compiled only"
    )
    width = _name_width(results, 20)
    print(f"{'step':<{width}} {'compile s':>10} {'GFLOP/step':>11} {'XLA MiB':>8}")
    for name, r in results.items():
        print(
            f"{name:<{width}} {r['compile_sec']:>10.2f} {r['flops'] / 1e9:>11.4g} "
            f"{r['step_bytes'] / 2**20:>8.0f}"
        )
    return results


STEP_VARIANTS = ("plain", "rspc", "plain_2x")


def check_variants(names: list[str]) -> None:
    """Refuses an unknown variant, or switch choice, before any step is built."""
    known = [*STEP_VARIANTS, *sorted(ablations.ABLATIONS)]
    for name in names:
        if name.split("@")[0] not in known:
            raise SystemExit(
                f"unknown step variant {name!r} in --variants: pass a comma-separated list of "
                f"{', '.join(known)}, each optionally followed by @SWITCH=CHOICE"
            )
        try:
            with variant_switches(name):
                pass
        except ConfigError as error:
            raise SystemExit(f"--variants={name}: {error}") from None


def _name_width(names, narrowest: int) -> int:
    """The width of a table's first column: switch variants' names run long."""
    return max(narrowest, *(len(name) + 1 for name in names))


def variant_switches(name: str) -> contextlib.ExitStack:
    """The implementation switches (rspc_jax.models.ops) that a variant's name sets after
    '@', entered: 'rspc@RSPC_JAX_CPU_PRODUCTS=xla' is the RSPC step traced and compiled with
    jaxlib's default products, so that `--variants=rspc,rspc@RSPC_JAX_CPU_PRODUCTS=xla
    --interleave` is a same-process A/B of the choice."""
    stack = contextlib.ExitStack()
    with stack:
        for setting in name.split("@")[1:]:
            variable, _, choice = setting.partition("=")
            stack.enter_context(ops.override(variable, choice))
        return stack.pop_all()


def variant_config(config, name: str):
    """A copy of `config` switched to variant `name`. 'plain_2x' is the plain step on twice
    the batch, the images RSPC's one forward puts through the classifier: rspc / plain_2x
    is what RSPC costs beyond the doubled batch, which alone can take more than twice the
    time once a step's buffers outgrow the caches."""
    config = config.copy_and_resolve_references()
    name = name.split("@")[0]  # the switches: `variant_switches`
    if name in STEP_VARIANTS:
        config.rspc.enabled = name == "rspc"
        if name == "plain_2x":
            config.batch_size *= 2
        return config
    return ablations.apply(config, name)


def timm_command(config, steps: int) -> list[str]:
    """The command that times timm's step of `config.model_name` (rspc_jax.tools.timm_step)."""
    mix = config.mixup
    if (mix.mixup_alpha > 0 or mix.cutmix_alpha > 0) and config.batch_size % 2:
        raise SystemExit(
            f"--compare_timm mixes batches as the config does, and timm's Mixup pairs images, "
            f"so it needs an even batch (got {config.batch_size}): pass an even --batch, or "
            "--config.mixup.mixup_alpha=0 --config.mixup.cutmix_alpha=0 to time both "
            "without mixing"
        )
    spec = datasets.dataset_spec(config.dataset)
    return [
        sys.executable,
        "-m",
        "rspc_jax.tools.timm_step",
        f"--model={config.model_name}",
        f"--batch={config.batch_size}",
        f"--image_size={config.image_size}",
        f"--num_classes={spec.num_classes}",
        f"--steps={steps}",
        f"--drop_path={config.model.get('drop_path_rate', 0.0)}",
        f"--label_smoothing={config.label_smoothing}",
        f"--ema_decay={config.ema_decay}",
        f"--mixup_alpha={config.mixup.mixup_alpha}",
        f"--cutmix_alpha={config.mixup.cutmix_alpha}",
        f"--mixup_prob={config.mixup.prob}",
        f"--switch_prob={config.mixup.switch_prob}",
        # On the device our step runs on, at our compute precision.
        f"--device={'cuda' if jax.default_backend() == 'gpu' else 'cpu'}",
        f"--bfloat16={config.compute_dtype == 'bfloat16'}",
    ]


def _run_reference(label: str, command: list[str]) -> dict:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"the reference step {label!r} failed: {reason}")
    lines = done.stdout.strip().splitlines()
    try:
        record = json.loads(lines[-1])
        record["times"] = [float(t) for t in record["times"]]
    except (IndexError, ValueError, KeyError, TypeError):
        raise SystemExit(
            f"the reference step {label!r} must print, as its last line, a JSON record with "
            f"'times' (seconds of each timed step); it printed {lines[-1:]!r}"
        ) from None
    return record


def compare_side_by_side(results: dict, references: dict, steps: int, rounds: int) -> dict:
    """Alternates, `rounds` times, each reference step (variant -> (label, command), run in
    a fresh process that prints a JSON record with 'times' and optionally 'peak_rss_bytes',
    'cores_busy' and 'framework') with `steps` more steps of each of our variants (from
    `print_table` with `keep_timers`), and prints the medians over all rounds: each of our
    variants' time ratio to the reference of the same variant (else the first reference;
    < 1 = we are faster; with no reference at all, to our first variant), peak resident
    memories and cores kept busy, then how far each round's ratio strayed (lowest and
    highest). Interleaving keeps the machine's drift (10-20% over minutes on shared CPUs)
    out of the ratios; the spread shows what drift is left, which a single round's ratio
    does not."""
    samples = {label: [] for label, _ in references.values()} | {name: [] for name in results}
    busy = {name: [] for name in samples}
    round_medians = {name: [] for name in samples}
    records = {}
    host_memory.release_freed_memory()  # what the table freed since its steps: not theirs
    for _ in range(rounds):
        for label, command in references.values():
            records[label] = _run_reference(label, command)
            samples[label] += records[label]["times"]
            round_medians[label].append(statistics.median(records[label]["times"]))
            busy[label].append(records[label].get("cores_busy"))
        for name, r in results.items():
            r["time_steps"](1)  # warm-up: the threads idled while the reference ran
            times, cores = r["time_steps"](steps)
            samples[name] += times
            round_medians[name].append(statistics.median(times))
            busy[name].append(cores)
    medians = {name: statistics.median(times) for name, times in samples.items()}
    rss = {label: record.get("peak_rss_bytes") for label, record in records.items()}
    ours = timing.peak_rss_bytes()  # one process: every variant's
    rss |= {name: ours for name in results}
    device = {label: record.get("peak_device_bytes") for label, record in records.items()}
    ours_device = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    device |= {name: ours_device for name in results}
    device_column = any(device.values())  # accelerators: the allocators' peaks
    first = next(iter(references.values()))[0] if references else next(iter(results))
    against = {label: label for label in records}
    against |= {name: references.get(name, (first,))[0] for name in results}
    frameworks = sorted({r["framework"] for r in records.values() if r.get("framework")})
    compared = (
        f"side by side with {', '.join(frameworks) or 'the reference steps'}"
        if references
        else "our variants alone"
    )
    print(
        f"\n{compared}, {rounds} interleaved rounds of {steps} steps each"
        + "".join(
            f" ({name}: {steps} calls of {r['steps_per_call']} steps)"
            for name, r in results.items()
            if r.get("steps_per_call", 1) > 1
        )
        + (
            " (the reference processes start with our environment, the allocator included):"
            if references
            else ":"
        )
    )
    width = _name_width(medians, 24)
    print(
        f"{'step':<{width}} {'median step s':>14} {'x reference':>12} {'reference':<16} "
        f"{'peak RSS MiB':>13} {'cores busy':>11}"
        + (f" {'device MiB':>11}" if device_column else "")
    )
    for name, median in medians.items():
        memory = _mib(rss[name])
        cores = [c for c in busy[name] if c is not None]
        cores = f"{statistics.mean(cores):.2f}" if cores else "n/a"
        print(
            f"{name:<{width}} {median:>14.4f} {median / medians[against[name]]:>12.2f} "
            f"{against[name]:<16} {memory:>13} {cores:>11}"
            + (f" {_mib(device[name]):>11}" if device_column else "")
        )
    print(
        "peak RSS: VmHWM of each process (ours: every variant above, compiles included; "
        "run --variants=plain alone for the plain step's own). cores busy: CPU time over "
        "wall time of the timed steps."
        + (" device MiB: the peak of each process's device allocator." if device_column else "")
    )
    _print_round_spread(round_medians, against)
    _print_step_ratios(medians, " over the rounds")
    return medians


def _print_round_spread(round_medians: dict, against: dict) -> None:
    """The lowest and highest of the rounds' time ratios (each round's median step against
    its reference's in the same round), where there are several rounds."""
    spread = {
        name: [ours / theirs for ours, theirs in zip(times, round_medians[against[name]])]
        for name, times in round_medians.items()
        if against[name] != name and len(times) > 1
    }
    if spread:
        print(
            "x reference in single rounds (lowest-highest): "
            + ", ".join(f"{name} {min(r):.2f}-{max(r):.2f}" for name, r in spread.items())
        )


# (variant, baseline, the time ratio expected if nothing but the images' number mattered):
# RSPC puts twice the images through the model, plain_2x is the plain step on twice the
# batch, so rspc / plain_2x is what the method costs beyond the doubled batch and
# plain_2x / plain what doubling the batch costs beyond twice the work.
_COMPARISONS = (("rspc", "plain", 2.0), ("rspc", "plain_2x", 1.0), ("plain_2x", "plain", 2.0))


def step_comparisons(variants) -> list[tuple[str, str, float]]:
    """The `_COMPARISONS` whose two variants were both run."""
    return [c for c in _COMPARISONS if {c[0], c[1]} <= set(variants)]


def _print_step_ratios(seconds: dict, over: str = "") -> None:
    """The step-time ratios of `step_comparisons`, where timed."""
    for name, baseline, _ in step_comparisons(seconds):
        ratio = seconds[name] / seconds[baseline]
        print(f"ratio {name}/{baseline} step time{over}: {ratio:.2f}")


def _mib(size) -> str:
    return f"{size / 2**20:.0f}" if size else "n/a"
