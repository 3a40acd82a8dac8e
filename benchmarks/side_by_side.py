"""Our variants' steps interleaved with reference steps (timm's, the official code's, any
command that prints a JSON record), or with each other alone (`--interleave`), round after
round, and their medians over all rounds: ratios that the machine's drift over minutes
does not bias, with the spread of the single rounds' ratios to show what drift is left."""

import dataclasses
import json
import statistics
import subprocess
import sys

import jax

from benchmarks import timing
from benchmarks.tables import mib, name_width, print_step_ratios
from rspc_jax import ConfigError, ReportedError
from rspc_jax.data import specs as datasets
from rspc_jax.training import host_memory


def timm_command(config, steps: int) -> list[str]:
    """The command that times timm's step of `config.model_name` (benchmarks.timm_step)."""
    mix = config.mixup
    if (mix.mixup_alpha > 0 or mix.cutmix_alpha > 0) and config.batch_size % 2:
        raise ConfigError(
            f"--compare_timm mixes batches as the config does, and timm's Mixup pairs images, "
            f"so it needs an even batch (got {config.batch_size}): pass an even --batch, or "
            "--config.mixup.mixup_alpha=0 --config.mixup.cutmix_alpha=0 to time both "
            "without mixing"
        )
    spec = datasets.dataset_spec(config.dataset)
    return [
        sys.executable,
        "-m",
        "benchmarks.timm_step",
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


def run_reference(label: str, command: list[str]) -> dict:
    """Runs a reference step's command and reads its last printed line: a JSON record with
    'times' (seconds of each timed step) and optionally 'peak_rss_bytes',
    'peak_device_bytes', 'cores_busy' and 'framework'."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ReportedError(f"the reference step {label!r} failed: {reason}")
    lines = done.stdout.strip().splitlines()
    try:
        record = json.loads(lines[-1])
        record["times"] = [float(t) for t in record["times"]]
    except (IndexError, ValueError, KeyError, TypeError):
        raise ReportedError(
            f"the reference step {label!r} must print, as its last line, a JSON record with "
            f"'times' (seconds of each timed step); it printed {lines[-1:]!r}"
        ) from None
    return record


@dataclasses.dataclass
class Rounds:
    """What the interleaved rounds measured, by step (our variant's name or a reference's
    label): every step time, each round's median and cores busy; the references' records."""

    times: dict[str, list[float]]
    round_medians: dict[str, list[float]]
    busy: dict[str, list]
    records: dict[str, dict]


def run_rounds(results: dict, references: dict, steps: int, rounds: int) -> Rounds:
    """Alternates, `rounds` times, each reference step (variant -> (label, command), a
    fresh process each round) with `steps` more steps of each of our variants (results of
    `measure.time_variants` with `keep_timers`)."""
    names = [label for label, _ in references.values()] + list(results)
    measured = Rounds({n: [] for n in names}, {n: [] for n in names}, {n: [] for n in names}, {})
    host_memory.release_freed_memory()  # what the table freed since its steps: not theirs
    for _ in range(rounds):
        for label, command in references.values():
            record = measured.records[label] = run_reference(label, command)
            _add(measured, label, record["times"], record.get("cores_busy"))
        for name, r in results.items():
            r["time_steps"](1)  # warm-up: the threads idled while the reference ran
            _add(measured, name, *r["time_steps"](steps))
    return measured


def _add(measured: Rounds, name: str, times: list[float], cores_busy) -> None:
    measured.times[name] += times
    measured.round_medians[name].append(statistics.median(times))
    measured.busy[name].append(cores_busy)


def ratios(results: dict, references: dict, measured: Rounds) -> dict[str, dict]:
    """step -> its median over all rounds, the step it is compared with (the reference of
    the same variant, else the first reference; with no reference at all, our first
    variant), the ratio of the medians (< 1: faster) and the lowest and highest ratio of
    single rounds (None with one round, or for the step compared with itself)."""
    medians = {name: statistics.median(times) for name, times in measured.times.items()}
    first = next(iter(references.values()))[0] if references else next(iter(results))
    against = {label: label for label, _ in references.values()}
    against |= {name: references.get(name, (first,))[0] for name in results}
    rows = {}
    for name, median in medians.items():
        base = against[name]
        single = [a / b for a, b in zip(measured.round_medians[name], measured.round_medians[base])]
        spread = (min(single), max(single)) if base != name and len(single) > 1 else None
        rows[name] = dict(
            median_sec=median, against=base, ratio=median / medians[base], spread=spread
        )
    return rows


def compare_side_by_side(results: dict, references: dict, steps: int, rounds: int) -> dict:
    """Runs the interleaved rounds (`run_rounds`), prints the medians, ratios, peak
    memories and cores busy, the single rounds' spread and the ratios between our
    variants; returns `ratios`'s rows."""
    measured = run_rounds(results, references, steps, rounds)
    rows = ratios(results, references, measured)
    _print_rows(rows, results, references, measured, steps, rounds)
    spread = {name: row["spread"] for name, row in rows.items() if row["spread"]}
    if spread:
        print(
            "x reference in single rounds (lowest-highest): "
            + ", ".join(f"{name} {lo:.2f}-{hi:.2f}" for name, (lo, hi) in spread.items())
        )
    print_step_ratios({name: row["median_sec"] for name, row in rows.items()}, " over the rounds")
    return rows


def _print_rows(rows, results, references, measured: Rounds, steps: int, rounds: int) -> None:
    """The side-by-side table: one row per step."""
    rss = {label: record.get("peak_rss_bytes") for label, record in measured.records.items()}
    rss |= dict.fromkeys(results, timing.peak_rss_bytes())  # one process: every variant's
    device = {label: r.get("peak_device_bytes") for label, r in measured.records.items()}
    ours_device = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    device |= dict.fromkeys(results, ours_device)
    device_column = any(device.values())  # accelerators: the allocators' peaks
    frameworks = sorted({r["framework"] for r in measured.records.values() if r.get("framework")})
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
    width = name_width(rows, 24)
    print(
        f"{'step':<{width}} {'median step s':>14} {'x reference':>12} {'reference':<16} "
        f"{'peak RSS MiB':>13} {'cores busy':>11}"
        + (f" {'device MiB':>11}" if device_column else "")
    )
    for name, row in rows.items():
        cores = [c for c in measured.busy[name] if c is not None]
        cores = f"{statistics.mean(cores):.2f}" if cores else "n/a"
        print(
            f"{name:<{width}} {row['median_sec']:>14.4f} {row['ratio']:>12.2f} "
            f"{row['against']:<16} {mib(rss[name]):>13} {cores:>11}"
            + (f" {mib(device[name]):>11}" if device_column else "")
        )
    print(
        "peak RSS: VmHWM of each process (ours: every variant above, compiles included; "
        "run --variants=plain alone for the plain step's own). cores busy: CPU time over "
        "wall time of the timed steps."
        + (" device MiB: the peak of each process's device allocator." if device_column else "")
    )
