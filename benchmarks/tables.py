"""The benchmark's printed tables: the timed variants, the compiled-only variants, the
step-time ratios between variants and the profiles' top ops."""

import jax

from benchmarks import profiling
from benchmarks.variants import step_comparisons
from rspc_jax.tools import allocator


def name_width(names, narrowest: int) -> int:
    """The width of a table's first column: the names of variants with choices run long."""
    return max(narrowest, *(len(name) + 1 for name in names))


def mib(size) -> str:
    return f"{size / 2**20:.0f}" if size else "n/a"


def print_step_ratios(seconds: dict, over: str = "") -> None:
    """The step-time ratios of `step_comparisons`, where timed."""
    for name, baseline, _ in step_comparisons(seconds):
        ratio = seconds[name] / seconds[baseline]
        print(f"ratio {name}/{baseline} step time{over}: {ratio:.2f}")


def print_table(config, results: dict, steps: int) -> None:
    """`measure.time_variants`'s results as a table: compile time, median step time,
    images/s (clean images per step / median), steps/s, the step-time ratio to the first
    variant, XLA's FLOP count of the step with the model FLOPs utilisation (on GPUs/TPUs),
    XLA's memory estimate, the device's peak memory and the cores kept busy; then the
    ratios between variants and, where profiled, the top ops."""
    print(
        f"model {config.model_name}, global batch {config.batch_size} clean images per step "
        f"(RSPC, TRADES and plain_2x put 2x through the classifier), "
        f"{jax.device_count()} x {jax.devices()[0].device_kind}, {steps} timed "
        + (f"calls of {config.steps_per_call} steps" if config.steps_per_call > 1 else "steps")
    )
    if jax.default_backend() == "cpu":  # where the allocator decides the step time
        print(f"memory allocator: {allocator.describe()}")
    first = next(iter(results))
    width = name_width(results, 20)
    print(
        f"{'step':<{width}} {'compile s':>10} {'median step s':>14} {'images/s':>10} "
        f"{'steps/s':>8} {'x ' + first:>10} {'GFLOP/step':>11} {'MFU':>6} "
        f"{'XLA MiB':>8} {'peak MiB':>9} {'cores busy':>11}"
    )
    for name, r in results.items():
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        print(
            f"{name:<{width}} {r['compile_sec']:>10.2f} {r['median_sec']:>14.4f} "
            f"{r['images_per_sec']:>10.1f} {1 / r['median_sec']:>8.2f} "
            f"{r['median_sec'] / results[first]['median_sec']:>10.2f} "
            f"{r['flops'] / 1e9:>11.4g} {mfu:>6} {r['step_bytes'] / 2**20:>8.0f} "
            f"{mib(r['peak_bytes']):>9} {r['cores_busy']:>11.2f}"
        )
    print(
        "GFLOP/step: XLA's cost analysis of one device's step as lowered (custom calls such as "
        "cuDNN's attention count none); MFU against the device's "
        "dense peak for the compute dtype (n/a where unknown, e.g. CPU); XLA MiB: its "
        "estimate of one step's memory; peak MiB: the device allocator's peak (accelerators); "
        "cores busy: the process's CPU time over the wall time of the timed steps."
    )
    print_step_ratios({name: r["median_sec"] for name, r in results.items()})
    _print_profiles(results)


def _print_profiles(results: dict) -> None:
    """Each profiled variant's top ops, by kind and alone, and the layers where a variant
    takes more than its expected share of a baseline's op time."""
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


def print_compile_table(config, results: dict) -> None:
    """`measure.compile_variants`'s results: compile times, FLOPs and XLA's estimates."""
    print(
        f"model {config.model_name}, global batch {config.batch_size}, "
        f"{jax.device_count()} x {jax.devices()[0].device_kind}, compiled only"
    )
    width = name_width(results, 20)
    print(f"{'step':<{width}} {'compile s':>10} {'GFLOP/step':>11} {'XLA MiB':>8}")
    for name, r in results.items():
        print(
            f"{name:<{width}} {r['compile_sec']:>10.2f} {r['flops'] / 1e9:>11.4g} "
            f"{r['step_bytes'] / 2**20:>8.0f}"
        )
