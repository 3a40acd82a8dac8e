"""Where a compiled step spends its time: a `jax.profiler` trace of a few steps, read back
with `jax.profiler.ProfileData`, summed per XLA op (thunk) and described by its HLO, or by
the model layer it belongs to (`by_scope`).

Used by `python -m benchmarks.train_step --profile_dir=DIR`, which prints the top ops of
every variant and, with plain and RSPC both profiled, the layers where RSPC's step takes
more than twice the plain step's time (`excess`); the trace stays in DIR for TensorBoard's
profile plugin or Perfetto.
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
_DEDUPLICATED = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*deduplicated_name=\"([\w.\-]+)\"", re.M
)
_OP_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?op_name=\"([^\"]*)\"", re.M)
_STEP_JIT = re.compile(r"^jit\([^()]*\)/")
_BLOCK_INDEX = re.compile(r"^(blocks?)_\d+$")


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
    return sum_ops(profile.planes, hlo_text, steps, count)


def sum_ops(planes, hlo_text: str, steps: int, count: int | None = 10) -> list[dict]:
    """`top_ops` of a trace's planes: on CPU the host threads' events, named by their HLO
    instruction; on a TPU its "XLA Ops" line; on a GPU every kernel of its streams, named by
    the instruction that launched it (XLA names a fusion's kernel after the instruction,
    '.' -> '_'; a library kernel names it in its "hlo_op" stat, except inside a CUDA graph,
    where it keeps its own name, as copies do: "library kernel").

    On CPU an op's time is its share of the wall time (`_wall_shares`): XLA:CPU runs a
    matrix product on several threads at once and independent ops side by side, so times
    summed over threads add up to more than the step took."""
    described = describe_ops(hlo_text)
    events = [(name, e) for name, e in _op_events(planes, hlo_text, described) if e.duration_ns > 0]
    if any(plane.name.startswith("/device:") for plane in planes):
        totals, calls = collections.Counter(), collections.Counter()
        for name, event in events:
            totals[name] += event.duration_ns
            calls[name] += 1
    else:
        totals, calls = _wall_shares(events)
    all_ops = sum(totals.values()) or 1
    return [
        dict(
            name=name,
            ms_per_step=nanoseconds / 1e6 / steps,
            share=nanoseconds / all_ops,
            calls_per_step=calls[name] / steps,
            what=described.get(name, "library kernel"),
        )
        for name, nanoseconds in totals.most_common(count)
    ]


def _wall_shares(events: list) -> tuple[collections.Counter, collections.Counter]:
    """(wall nanoseconds, calls) per op of (op name, event) pairs from several threads: each
    op's events are merged into calls (an op running on two threads at once is one call),
    and every instant is split evenly among the ops running at it."""
    spans: dict[str, list[list[int]]] = collections.defaultdict(list)
    for name, event in sorted(events, key=lambda item: item[1].start_ns):
        start, end = event.start_ns, event.start_ns + event.duration_ns
        merged = spans[name]
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    edges = sorted(
        (time, change, name)
        for name, merged in spans.items()
        for start, end in merged
        for time, change in ((start, 1), (end, -1))
    )
    totals, running, last = collections.Counter(), set(), None
    for time, change, name in edges:
        if running:
            for op in running:
                totals[op] += (time - last) / len(running)
        last = time
        if change > 0:
            running.add(name)
        else:
            running.discard(name)
    return totals, collections.Counter({name: len(merged) for name, merged in spans.items()})


def _op_events(planes, hlo_text: str, described: dict) -> list:
    """(op name, event) of the step's ops in the trace's planes."""
    lines = [(plane.name, line) for plane in planes for line in plane.lines]  # read once
    device = [line for plane, line in lines if plane.startswith("/device:")]
    ops_lines = [line for line in device if line.name == "XLA Ops"]
    streams = [line for line in device if line.name.startswith("Stream")]
    if ops_lines or not streams:  # TPU, or CPU: events named like an instruction of the HLO
        named = ops_lines or [line for _, line in lines]
        return [(e.name, e) for line in named for e in line.events if e.name in described]
    kernels = {name.replace(".", "_").replace("-", "_"): name for name in described}
    for instruction, shared in _DEDUPLICATED.findall(hlo_text):  # one kernel for several
        kernels.setdefault(shared.replace(".", "_").replace("-", "_"), instruction)
    return [
        (kernels.get(e.name) or _launched_by(e, described), e)
        for line in streams
        for e in line.events
    ]


def _launched_by(event, described: dict) -> str:
    """The instruction a library kernel ran for (its "hlo_op" stat), else the kernel's name."""
    instruction = dict(event.stats).get("hlo_op")
    return instruction if instruction in described else event.name


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


def scope_of(op_name: str) -> str:
    """The model layer an HLO instruction computes, from its op_name metadata: 'forward' or
    'backward' of the layer path with block indices folded (`RVT/transformers_0/blocks_*/
    mlp/dwconv`), or the op outside the model's autodiff (optimizer, EMA, checks, input)."""
    name = _STEP_JIT.sub("", op_name, count=1)
    for direction, prefix in (("backward", "transpose(jvp("), ("forward", "jvp(")):
        if name.startswith(prefix):
            inner, rest = _wrapped(name, len(prefix))
            rest = rest.removeprefix(")" * (prefix.count("(") - 1)).removeprefix("/")
            path = _layer_path(rest.split("/")[:-1])  # the last part is the primitive
            return f"{direction} {'/'.join([inner or '(model input)'] + path)}"
    return f"outside the model: {name.split('/')[0]}"


def _layer_path(parts: list[str]) -> list[str]:
    """Layer names with block indices folded. A transform's part (`jit(_pad)`, a custom
    gradient's `transpose(...)`) is dropped, and so is the repeat of the path that a name
    stack restarted inside it begins with."""
    path, echo = [], None
    for part in parts:
        if "(" in part:
            echo = 0
            continue
        part = _BLOCK_INDEX.sub(r"\1_*", part)
        if echo is not None and echo < len(path) and path[echo] == part:
            echo += 1
            continue
        echo = None
        path.append(part)
    return path


def _wrapped(text: str, start: int) -> tuple[str, str]:
    """(what stands inside the parenthesis opened just before `start`, what follows it)."""
    depth = 1
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i], text[i + 1 :]
    return text[start:], ""


def by_scope(rows: list[dict], hlo_text: str) -> dict[str, dict]:
    """`top_ops(..., count=None)` rows summed by `scope_of` their instruction (ms and calls
    per step); instructions without metadata count as 'outside the model: ?'."""
    scopes = {name: scope_of(op_name) for name, op_name in _OP_NAME.findall(hlo_text)}
    totals: dict[str, dict] = {}
    for r in rows:
        total = totals.setdefault(
            scopes.get(r["name"], "outside the model: ?"), dict(ms_per_step=0.0, calls=0.0)
        )
        total["ms_per_step"] += r["ms_per_step"]
        total["calls"] += r["calls_per_step"]
    return totals


def excess(scopes: dict[str, dict], baseline: dict[str, dict], factor: float) -> list[dict]:
    """Per scope, the op time beyond `factor` times the baseline's (RSPC's step against twice
    the plain one's: RSPC puts twice the images through the model), largest first."""
    rows = [
        dict(
            scope=scope,
            baseline_ms=baseline.get(scope, {}).get("ms_per_step", 0.0),
            ms=scopes.get(scope, {}).get("ms_per_step", 0.0),
        )
        for scope in set(scopes) | set(baseline)
    ]
    for r in rows:
        r["excess_ms"] = r["ms"] - factor * r["baseline_ms"]
    return sorted(rows, key=lambda r: (-r["excess_ms"], r["scope"]))


def print_excess(
    title: str, scopes: dict[str, dict], baseline: dict[str, dict], factor: float, count: int = 10
) -> None:
    """The `count` scopes with the most `excess` time, and the totals."""
    rows = excess(scopes, baseline, factor)
    total, base = sum(r["ms"] for r in rows), sum(r["baseline_ms"] for r in rows)
    print(
        f"\n{title}: op time beyond {factor:g}x by layer (per step; on CPU shares of the wall time; "
        f"all ops {total:.1f} against {factor:g} x {base:.1f} ms)"
    )
    print(f"{'beyond ms':>10} {'baseline ms':>12} {'ms':>9}  layer")
    for r in rows[:count]:
        print(f"{r['excess_ms']:>10.1f} {r['baseline_ms']:>12.1f} {r['ms']:>9.1f}  {r['scope']}")


def print_top_ops(title: str, rows: list[dict]) -> None:
    print(f"\ntop ops of {title} (per step; on CPU shares of the wall time):")
    print(f"{'op':<28} {'ms/step':>9} {'share':>6} {'calls':>6}  HLO")
    for r in rows:
        print(
            f"{r['name'][:28]:<28} {r['ms_per_step']:>9.1f} {100 * r['share']:>5.1f}% "
            f"{r['calls_per_step']:>6.0f}  {r['what'][:70]}"
        )
