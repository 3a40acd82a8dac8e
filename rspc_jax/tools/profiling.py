"""Where a compiled step spends its time: a `jax.profiler` trace of a few steps, read back
with `jax.profiler.ProfileData`, summed per XLA op (thunk) and described by its HLO.

Used by `python -m rspc_jax.benchmark --profile_dir=DIR`, which prints the top ops of
every variant; the trace stays in DIR for TensorBoard's profile plugin or Perfetto.
"""

import collections
from collections.abc import Callable
import glob
import os
import re

import jax

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = [^=]*?\s([a-z][\w\-]*)\(")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")


def trace(run_step: Callable[[], object], steps: int, directory: str) -> str:
    """Runs `run_step` (which must block) `steps` times under the profiler; the trace file."""
    with jax.profiler.trace(directory):
        for _ in range(steps):
            run_step()
    files = sorted(glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True))
    return files[-1]


def describe_ops(hlo_text: str) -> dict[str, str]:
    """instruction name -> its opcode; fusions list their called computation's main opcodes."""
    opcodes_of: dict[str, collections.Counter] = {}
    instructions: dict[str, tuple[str, str]] = {}
    computation = None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header and "=" not in line.split("{")[0]:
            computation = header.group(1)
            opcodes_of[computation] = collections.Counter()
            continue
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, opcode = match.groups()
        if computation is not None and opcode not in ("parameter", "constant", "tuple"):
            opcodes_of[computation][opcode] += 1
        calls = _CALLS.search(line)
        instructions[name] = (opcode, calls.group(1) if calls else "")
    described = {}
    for name, (opcode, called) in instructions.items():
        inner = opcodes_of.get(called)
        if inner:
            main = ", ".join(op for op, _ in inner.most_common(4))
            described[name] = f"{opcode}: {main}"
        else:
            described[name] = opcode
    return described


def top_ops(trace_file: str, hlo_text: str, steps: int, count: int | None = 10) -> list[dict]:
    """The `count` ops (None: all) with the most time per step, their share of all op time
    and calls."""
    profile = jax.profiler.ProfileData.from_file(trace_file)
    described = describe_ops(hlo_text)
    totals, calls = collections.Counter(), collections.Counter()
    for line in _op_lines(profile):
        for event in line.events:
            # Only the step's own ops: events named like an instruction of its HLO.
            if event.name in described and event.duration_ns > 0:
                totals[event.name] += event.duration_ns
                calls[event.name] += 1
    all_ops = sum(totals.values()) or 1
    return [
        dict(
            name=name,
            ms_per_step=nanoseconds / 1e6 / steps,
            share=nanoseconds / all_ops,
            calls_per_step=calls[name] / steps,
            what=described.get(name, ""),
        )
        for name, nanoseconds in totals.most_common(count)
    ]


def _op_lines(profile) -> list:
    """The trace lines that time the step's ops: on a GPU/TPU the device's "XLA Ops" line (its
    kernel and host launch lines repeat the same names and would count each op twice); on
    CPU, where ops run on host threads, every line."""
    device_ops = [
        line
        for plane in profile.planes
        if plane.name.startswith("/device:")
        for line in plane.lines
        if line.name == "XLA Ops"
    ]
    return device_ops or [line for plane in profile.planes for line in plane.lines]


def by_kind(rows: list[dict], count: int = 10) -> list[dict]:
    """`top_ops(..., count=None)` rows summed by what they are (their HLO description)."""
    kinds: dict[str, dict] = {}
    for r in rows:
        kind = kinds.setdefault(
            r["what"], dict(name=r["what"], ms_per_step=0.0, share=0.0, calls_per_step=0.0)
        )
        for key in ("ms_per_step", "share", "calls_per_step"):
            kind[key] += r[key]
    ranked = sorted(kinds.values(), key=lambda k: -k["ms_per_step"])[:count]
    return [dict(k, what=k["name"]) for k in ranked]


def print_top_ops(title: str, rows: list[dict]) -> None:
    print(f"\ntop ops of {title} (time summed over threads, per step):")
    print(f"{'op':<28} {'ms/step':>9} {'share':>6} {'calls':>6}  HLO")
    for r in rows:
        print(
            f"{r['name'][:28]:<28} {r['ms_per_step']:>9.1f} {100 * r['share']:>5.1f}% "
            f"{r['calls_per_step']:>6.0f}  {r['what'][:70]}"
        )
