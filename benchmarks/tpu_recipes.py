"""XLA:CPU's micro-batch plan checked by the TPU compiler, config by config and slice by slice
(docs/speed.md's TPU table).

    python -m benchmarks.tpu_recipes --configs=configs/rvt_ti.py,configs/rvt_s.py \
        --slices=v4-8,v5e-8,v5p-8,v4-32 --results=runs/tpu_recipes.json

Each config is taken as it stands (its dtype, sharding and remat; the RSPC step). XLA:CPU's
planner (rspc_jax.tools.memory_plan) finds the largest per-device micro-batch whose estimate
fits --headroom of each slice's chip memory: one search per chip memory, shared by the slices
that have it. The TPU compiler then compiles the step at that micro-batch for each slice's
topology, with the config's sharding over every chip: one compile per cell, where a TPU search
of the largest micro-batch (`python -m rspc_jax.plan`) is about 7 compiles of 10-16 min each
on a 2-core host. The table gives XLA:CPU's micro-batch and GiB, the TPU compiler's GiB at that
micro-batch (or its refusal), their ratio and the wall times: whether the CPU's plan is safe
on the TPU and how cautious it is.

Each finished search and cell is written to --results at once, so a run stopped midway goes on
where it was, and a cell found there (for the same config) is not compiled again;
`--print_only` prints the table of what is there.
"""

import hashlib
import importlib.util
import json
import os
import pathlib
import time

from absl import app, flags

from rspc_jax.tools import cli

_CONFIGS = flags.DEFINE_list("configs", [], "Config files (as for --config), in table order.")
_SLICES = flags.DEFINE_list("slices", ["v4-8", "v5e-8", "v5p-8", "v4-32"], "TPU slices.")
_RESULTS = flags.DEFINE_string("results", None, "JSON file of finished searches and cells.")
_HEADROOM = flags.DEFINE_float("headroom", 0.9, "The fraction of a chip's HBM to fill.")
_PRINT_ONLY = flags.DEFINE_bool(
    "print_only", False, "Print the table of --results; compile nothing."
)

GiB = 2**30


def load_config(path: str):
    """A config file's `get_config()`, as `--config=file.py[:arg]` reads it."""
    file, *arg = path.split(":", 1)
    spec = importlib.util.spec_from_file_location(pathlib.Path(file).stem, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(*arg)


def digest(config) -> str:
    return hashlib.sha256(config.to_json(sort_keys=True).encode()).hexdigest()[:16]


class Results:
    """The --results file: {'estimates': {config: XLA:CPU bytes and seconds by batch},
    'searches': {config@budget GiB: ...}, 'cells': {config@slice: ...}}, each entry with the
    digest of the config it was measured for, written at once."""

    def __init__(self, path: str):
        self.path = pathlib.Path(path)
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {}
        for kind in ("estimates", "searches", "cells"):
            self.data.setdefault(kind, {})

    def get(self, kind: str, key: str, config_digest: str):
        found = self.data[kind].get(key)
        return found if found and found["config_digest"] == config_digest else None

    def put(self, kind: str, key: str, entry: dict) -> None:
        self.data[kind][key] = entry
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps(self.data, indent=1, sort_keys=True))
        os.replace(partial, self.path)


def xla_cpu_search(config, budget: float, results: Results, name: str, config_digest: str):
    """XLA:CPU's largest micro-batch within `budget` bytes (memory_plan's search, the RSPC
    step, the config's remat), kept in `results`; every estimate is kept as it is made, so
    the config's searches for other chip memories, and a resumed run, reuse it."""
    from rspc_jax.tools import memory_plan

    key = f"{name}@{budget / GiB:.2f}"
    found = results.get("searches", key, config_digest)
    if found:
        return found
    kept = results.get("estimates", name, config_digest) or dict(
        config_digest=config_digest, bytes={}, seconds={}
    )
    measured = {int(b): v for b, v in kept["bytes"].items()}

    def estimate(batch):
        start = time.perf_counter()
        size = memory_plan.step_bytes(config, batch, "rspc", bool(config.remat))
        kept["bytes"][str(batch)], kept["seconds"][str(batch)] = size, time.perf_counter() - start
        results.put("estimates", name, kept)
        seconds = kept["seconds"][str(batch)]
        print(
            f"XLA:CPU: {name} at {batch} per device: {size / GiB:.2f} GiB ({seconds:.0f} s)",
            flush=True,
        )
        return size

    fit = memory_plan.largest_batch(estimate, budget, measured)
    entry = dict(config_digest=config_digest, micro=fit.batch, bytes=fit.bytes, proven=fit.proven)
    results.put("searches", key, entry)
    return entry


def tpu_cell(config, name, slice_name, search, results: Results, digest_: str, headroom: float):
    """The TPU compiler's figure for the RSPC step at XLA:CPU's micro-batch on one slice."""
    from rspc_jax.tools import memory_plan, tpu_compile

    key = f"{name}@{slice_name}"
    found = results.get("cells", key, digest_)
    if found:
        return found
    step_config = memory_plan.variant_config(config, "rspc")
    step_config.grad_accum_steps = 1
    micro = search["micro"]
    print(f"TPU compiler: {name} on {slice_name} at {micro} per chip ...", flush=True)
    compiled = tpu_compile.train_step(step_config, slice_name, micro, headroom) if micro else None
    entry = dict(
        config_digest=digest_,
        micro=micro,
        xla_cpu_bytes=search["bytes"],
        tpu_bytes=compiled.bytes if compiled else 0,
        fits=bool(compiled and compiled.fits),
        refused=bool(compiled and compiled.refusal),
        seconds=compiled.seconds if compiled else 0.0,
    )
    results.put("cells", key, entry)
    print(f"TPU compiler: {name} on {slice_name} at {micro} per chip: {entry}", flush=True)
    return entry


def run(config_paths, slice_names, results: Results, headroom: float) -> list[tuple]:
    """Every (config, slice) cell, searching and compiling only what `results` lacks."""
    from rspc_jax.tools import tpu_compile

    slices = {n: tpu_compile.check_slice(n) for n in slice_names}
    rows = []
    for path in config_paths:
        config = load_config(path)
        config_digest = digest(config)
        for slice_name, tpu in slices.items():
            search = xla_cpu_search(config, headroom * tpu.hbm, results, path, config_digest)
            cell = tpu_cell(config, path, slice_name, search, results, config_digest, headroom)
            rows.append((path, config, slice_name, cell))
    return rows


def print_table(rows, headroom: float) -> None:
    """The cells as docs/speed.md's Markdown table."""
    print(
        "| config (dtype, sharding, remat) | slice | XLA:CPU max micro (GiB) "
        "| TPU compiler at that micro (GiB per chip) | XLA:CPU / TPU GiB | TPU compile |"
    )
    print("|---|---|---|---|---:|---:|")
    for path, config, slice_name, cell in rows:
        setup = (
            f"{config.compute_dtype}, {config.sharding}, remat {'on' if config.remat else 'off'}"
        )
        if not cell["micro"]:
            print(f"| {path} ({setup}) | {slice_name} | < 8 | - | - | - |")
            continue
        verdict = "refused" if cell["refused"] else ("fits" if cell["fits"] else "over budget")
        ratio = cell["xla_cpu_bytes"] / cell["tpu_bytes"] if cell["tpu_bytes"] else float("nan")
        print(
            f"| {path} ({setup}) | {slice_name} | {cell['micro']} "
            f"({cell['xla_cpu_bytes'] / GiB:.2f}) | {verdict} ({cell['tpu_bytes'] / GiB:.2f}) "
            f"| {ratio:.2f} | {cell['seconds'] / 60:.1f} min |"
        )
    print(
        f"XLA:CPU max micro: the largest multiple of 8 per chip whose XLA:CPU estimate fits "
        f"{headroom:g} of the chip's HBM (remat as the config says, one device, a "
        "sharded state counted whole); TPU compiler: that micro-batch's RSPC step compiled "
        "for the slice with the config's sharding over every chip (refused: "
        "RESOURCE_EXHAUSTED at the figure shown)."
    )


def print_estimates(results: Results, config_paths) -> None:
    """How many XLA:CPU compiles each config's searches took, and their wall time."""
    for path in config_paths:
        kept = results.data["estimates"].get(path)
        if kept:
            print(
                f"XLA:CPU estimates of {path}: {len(kept['bytes'])} compiles, "
                f"{sum(kept['seconds'].values()) / 60:.1f} min"
            )


def main(argv):
    cli.start(argv)
    if not _RESULTS.value:
        raise app.UsageError("pass --results=FILE.json (finished cells are kept there)")
    results = Results(_RESULTS.value)
    if _PRINT_ONLY.value:
        rows = [
            (path, load_config(path), slice_name, results.data["cells"][f"{path}@{slice_name}"])
            for path in _CONFIGS.value
            for slice_name in _SLICES.value
            if f"{path}@{slice_name}" in results.data["cells"]
        ]
        print_table(rows, _HEADROOM.value)
        return print_estimates(results, _CONFIGS.value)
    from rspc_jax.tools import memory_plan, tpu_compile

    if not tpu_compile.available():
        raise app.UsageError("the TPU compiler needs libtpu: pip install -r requirements-tpu.txt")
    tpu_compile.prepare_environment()
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {memory_plan.XLA_FLAGS}".strip()
    print_table(run(_CONFIGS.value, _SLICES.value, results, _HEADROOM.value), _HEADROOM.value)
    print_estimates(results, _CONFIGS.value)


if __name__ == "__main__":
    cli.run(main)
