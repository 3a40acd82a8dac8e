"""How large a per-device micro-batch fits a device's memory, and how many gradient
accumulation steps then reach the config's global batch on a slice (the library of
`python -m rspc_jax.plan`): sizing a run for a TPU slice or GPU before renting it.

TPU slices are measured by the TPU compiler where libtpu is installed (`tpu_plan`,
rspc_jax.tools.tpu_compile): the config's step for the slice's real topology, sharded over
every chip, its figure the TPU's own. Elsewhere, and for GPUs and v3, the measure is XLA's
memory analysis of the compiled train step (`compiled_bytes`):
the step as training jits it, on a mesh of one device, lowered from abstract state so that
nothing is allocated, with the accelerators' window ops (XLA's convolutions, not the CPU's
im2col forms, whose gathered windows would inflate the estimate), XLA's own schedule, not
the memory-optimized one that steps run with on CPU (`ops.compiler_options`), whose estimate
is smaller (the accelerators schedule with their own compilers), and XLA's own products, not
the CPU steps' oneDNN ones. It is compiled by XLA:CPU wherever this runs, with XLA_FLAGS
below, whose buffer assignment is not the TPU's or GPU's: those pad layouts to their tiles,
fuse differently and need workspace. The numbers are estimates, which is why the budget is a
fraction (`headroom`) of the device's memory.
"""

import functools
import math
import time
from typing import NamedTuple

from absl import logging
import jax
from jax.sharding import Mesh
import numpy as np

from rspc_jax import ConfigError, parallel
from rspc_jax.data import specs as datasets
from rspc_jax.models import ops
from rspc_jax.tools import tpu_compile
from rspc_jax.training import ablations, setup
from rspc_jax.training.memory_check import compiled_bytes

GiB = 2**30

# Set before JAX starts (`python -m rspc_jax.plan` does). XLA:CPU otherwise drops the optimization barriers
# that keep rematerialised activations apart early in its pipeline (the pass named here), and
# common-subexpression elimination then merges the recomputation back into the forward pass:
# with remat on, the compiled step and its memory were those without (JAX's remat relies on
# the accelerators' compilers keeping the barriers through scheduling). The other two make
# LLVM's code generation, which comes after the memory analysis, cheaper (the tests'
# settings): they change the compile time, not the estimate.
XLA_FLAGS = (
    "--xla_disable_hlo_passes=cse_barrier_expander "
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
)

# name -> (JAX devices, memory per device in bytes): the vendors' nominal HBM capacities. A
# TPU v3 chip has two TensorCores, each its own JAX device with half of the chip's 32 GiB;
# v4 and v5p chips are one device each (their two cores act as one); a v5e chip has one
# core. The runtime keeps part of it for itself (a v5e shows about 15.75 of its 16 GiB), and
# JAX on GPUs preallocates 75% unless XLA_PYTHON_CLIENT_MEM_FRACTION says more.
SLICES = {
    "v3-8": (8, 16 * GiB),
    "v4-8": (4, 32 * GiB),
    "v5e-8": (8, 16 * GiB),
    "v5p-8": (4, 95 * GiB),
    "h100": (1, 80 * GiB),
    "a100-40": (1, 40 * GiB),
    "a100-80": (1, 80 * GiB),
}

# Micro-batches are multiples of 8: finer than powers of two (which can waste up to half of the
# memory) and a whole number of TPU sublanes. The accumulation plan then takes the largest
# divisor of the per-device batch that fits, which is a power of two for the usual batches.
MULTIPLE = 8
MAX_COMPILES = 5  # secant guesses per memory budget after the first two batches


def _known_slices() -> dict:
    """SLICES and every TPU slice the TPU compiler knows (tpu_compile.SLICES)."""
    tpus = {n: (t.chips, t.hbm) for n, t in tpu_compile.SLICES.items()}
    return {**SLICES, **tpus}


def resolve_slices(names: str) -> dict:
    """{name: (devices, bytes per device)} of a comma-separated list ('all' = SLICES and
    v6e-8)."""
    known = _known_slices()
    if names == "all":
        return {n: known[n] for n in (*SLICES, "v6e-8")}
    chosen = [name.strip() for name in names.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in known]
    if unknown or not chosen:
        listed = ", ".join(f"{n} ({d} x {b // GiB} GiB)" for n, (d, b) in SLICES.items())
        raise ConfigError(
            f"unknown slice {', '.join(map(repr, unknown)) or 'list (empty)'}; pass "
            f"--slices=all or a comma-separated list of the known slices: {listed}, and "
            f"with the TPU compiler {', '.join(tpu_compile.SLICES)}"
        )
    return {name: known[name] for name in chosen}


def by_tpu_compiler(slices: dict, compiler: str) -> tuple[dict, dict]:
    """`slices` split into those the TPU compiler measures and those XLA:CPU estimates:
    `compiler` 'auto' gives every TPU slice it knows to the TPU compiler where libtpu is
    installed, 'tpu' insists on it, 'xla_cpu' estimates all."""
    tpu = {n: v for n, v in slices.items() if n in tpu_compile.SLICES}
    if compiler == "xla_cpu" or (compiler == "auto" and not tpu_compile.available()):
        tpu = {}
    elif compiler == "tpu" and not tpu_compile.available():
        raise ConfigError(
            "--compiler=tpu needs libtpu, the TPU compiler: pip install -r requirements-tpu.txt "
            "(no TPU needed), or pass --compiler=xla_cpu for XLA:CPU's estimate"
        )
    return tpu, {n: v for n, v in slices.items() if n not in tpu}


# The step variants besides the ablations of rspc_jax.training.ablations.
STEP_VARIANTS = ("plain", "rspc")


def check_variants(names: list[str], known: tuple[str, ...] = STEP_VARIANTS) -> None:
    """Refuses a variant that is neither one of `known` nor an ablation, before any step is
    built."""
    choices = [*known, *sorted(ablations.ABLATIONS)]
    for name in names:
        if name not in choices:
            raise ConfigError(
                f"unknown step variant {name!r} in --variants: pass a comma-separated list of "
                f"{', '.join(choices)}"
            )


def variant_config(config, name: str):
    """A copy of `config` switched to step variant `name`: 'plain' (RSPC off), 'rspc' (on)
    or an ablation's name."""
    config = config.copy_and_resolve_references()
    if name in STEP_VARIANTS:
        config.rspc.enabled = name == "rspc"
        return config
    return ablations.apply(config, name)


def step_bytes(config, per_device_batch: int, variant: str = "rspc", remat: bool = False) -> int:
    """XLA's memory estimate (bytes) of one device's train step of `variant` ('plain', 'rspc'
    or an ablation) at `per_device_batch` images, compiled without allocating anything. The
    state is laid out as `config` says (replicated unless the config shards it)."""
    config = variant_config(config, variant)
    config.remat = remat
    config.grad_accum_steps = 1  # one micro-batch per compiled step
    mesh = Mesh(np.asarray(jax.devices("cpu")[:1]), (parallel.DATA_AXIS,))
    spec = datasets.dataset_spec(config.dataset)
    batch = setup.abstract_batch(mesh, per_device_batch, config)
    with ops.implementations(
        window_ops="xla", cpu_schedule="xla", cpu_products="xla", dense_gradient="xla"
    ):
        model = setup.build_model(config, spec.num_classes)
        parts = setup.build(config, model, spec, mesh, steps_per_epoch=1000, total_steps=1000)
        state = jax.eval_shape(parts.init, jax.random.PRNGKey(0))
        compiled = parts.train_step.lower(state, batch).compile()
    return compiled_bytes(compiled)


class Fit(NamedTuple):
    batch: int  # the largest fitting multiple of MULTIPLE found; 0 if MULTIPLE does not fit
    bytes: int  # the estimate of `batch` (of MULTIPLE when it does not fit)
    proven: bool  # batch + MULTIPLE was measured and does not fit


def largest_batch(estimate, budget: float, measured: dict, max_compiles: int = MAX_COMPILES) -> Fit:
    """The largest multiple of MULTIPLE whose `estimate(batch)` (bytes) fits `budget`.

    Memory is close to affine in the batch, so each guess is the secant through the two
    measured batches nearest the budget, and a batch m is the answer once m fits and
    m + MULTIPLE is measured not to (usually two guesses). `measured` (batch -> bytes) keeps
    every estimate, so that searches for other budgets reuse them; after the first two
    (MULTIPLE and 8 * MULTIPLE) at most `max_compiles` are made here, else the best batch
    found is returned unproven."""

    def measure(batch):
        if batch not in measured:
            measured[batch] = estimate(batch)
        return measured[batch]

    if measure(MULTIPLE) > budget:
        return Fit(0, measured[MULTIPLE], True)
    if len(measured) < 2:
        measure(8 * MULTIPLE)
    for compiles in range(max_compiles + 1):
        low = max(b for b, v in measured.items() if v <= budget)
        high = min((b for b, v in measured.items() if v > budget), default=None)
        if high == low + MULTIPLE or compiles == max_compiles:
            return Fit(low, measured[low], high == low + MULTIPLE)
        measure(_secant_guess(measured, budget, low, high))


def _secant_guess(measured: dict, budget: float, low: int, high) -> int:
    """The batch where the line through the bracket (low, high), or through the two largest
    fitting batches when nothing measured is over the budget, reaches it; rounded down to a
    multiple of MULTIPLE strictly inside the bracket."""
    if high is None:
        b1, b2 = sorted(b for b, v in measured.items() if v <= budget)[-2:]
    else:
        b1, b2 = low, high
    slope = (measured[b2] - measured[b1]) / (b2 - b1)
    batch = b1 + (budget - measured[b1]) / slope if slope > 0 else 2 * low
    guess = max(math.floor(batch / MULTIPLE) * MULTIPLE, low + MULTIPLE)
    return guess if high is None else min(guess, high - MULTIPLE)


def accumulation(global_batch: int, devices: int, micro: int):
    """(micro-batch, grad_accum_steps) with devices * micro-batch * steps == global_batch: the
    micro-batch is the largest divisor of the per-device batch up to `micro`. None when the
    devices do not split the global batch evenly or no micro-batch fits."""
    if global_batch % devices or micro < 1:
        return None
    per_device = global_batch // devices
    used = max(d for d in range(1, min(micro, per_device) + 1) if per_device % d == 0)
    return used, per_device // used


class Row(NamedTuple):
    slice: str
    devices: int
    device_bytes: int
    variant: str
    remat: bool
    fit: Fit
    accumulation: tuple | None  # (micro-batch, grad_accum_steps)
    compiler: str = "XLA:CPU"  # which compiler's memory analysis measured it


def plan(config, variants, slices: dict, headroom: float, estimate=step_bytes) -> list[Row]:
    """For every variant, remat off and on, and slice: the largest micro-batch whose estimate
    fits `headroom` of a device's memory, and the accumulation that reaches config.batch_size.
    Slices with the same memory share a search; searches of one step share their compiles."""
    budgets = sorted({device_bytes * headroom for _, device_bytes in slices.values()})
    searches = [(variant, remat) for variant in variants for remat in (False, True)]
    progress = _Progress(searches, per_search=2 + MAX_COMPILES * len(budgets))
    rows = []
    for variant, remat in searches:
        measured = {}
        step = functools.partial(progress.logged, estimate, config, variant, remat)
        fits = {budget: largest_batch(step, budget, measured) for budget in budgets}
        progress.search_done()
        for name, (devices, device_bytes) in slices.items():
            fit = fits[device_bytes * headroom]
            steps = accumulation(config.batch_size, devices, fit.batch)
            rows.append(Row(name, devices, device_bytes, variant, remat, fit, steps))
    return rows


def tpu_plan(config, variants, slices: dict, headroom: float) -> list[Row]:
    """For every variant and TPU slice: the largest per-chip micro-batch whose step, compiled
    by the TPU compiler for the slice's topology with the config's sharding, remat and dtype,
    fits `headroom` of a chip's HBM (a program the compiler refuses does not fit, at its
    figure), and the accumulation that reaches config.batch_size."""
    rows, done = [], [0]
    for variant in variants:
        step_config = variant_config(config, variant)
        step_config.grad_accum_steps = 1  # one micro-batch per compiled step
        for name, (chips, hbm) in slices.items():
            fit = largest_batch(
                functools.partial(_tpu_trial, step_config, name, headroom, variant, done),
                headroom * hbm,
                {},
            )
            steps = accumulation(config.batch_size, chips, fit.batch)
            rows.append(Row(name, chips, hbm, variant, config.remat, fit, steps, "TPU"))
    return rows


def _tpu_trial(config, name: str, headroom: float, variant: str, done: list, batch: int) -> int:
    """One TPU compile of the search, logged (a full-size step takes minutes on a CPU)."""
    result = tpu_compile.train_step(config, name, batch, headroom)
    done[0] += 1
    logging.info(
        "TPU compile %d: %s, %s step, %d per chip: %.2f GiB per chip, %s (%.0f s)",
        done[0],
        name,
        variant,
        batch,
        result.bytes / GiB,
        "fits" if result.fits else "does not fit",
        result.seconds,
    )
    return result.bytes if (result.fits or result.bytes) else 2**62


class _Progress:
    """One log line per compiled trial: which search, the estimate, and how many trials are
    left at most with the time that takes at the mean so far (a full-size step takes minutes
    to compile on CPU). The bound is `per_search` for each search not finished: two starting
    batches and at most MAX_COMPILES secant guesses per distinct memory budget."""

    def __init__(self, searches: list, per_search: int):
        self.searches, self.per_search = searches, per_search
        self.finished = self.in_search = self.done = 0
        self.seconds = 0.0

    def search_done(self) -> None:
        self.finished, self.in_search = self.finished + 1, 0

    def logged(self, estimate, config, variant: str, remat: bool, batch: int) -> int:
        start = time.perf_counter()
        size = estimate(config, batch, variant, remat)
        self.seconds += time.perf_counter() - start
        self.done, self.in_search = self.done + 1, self.in_search + 1
        left = (len(self.searches) - self.finished) * self.per_search - self.in_search
        logging.info(
            "trial %d (search %d of %d: %s step, remat %s), batch %d: %.2f GiB; at most %d "
            "trials left, at most %.0f min at %.0f s each",
            self.done,
            self.finished + 1,
            len(self.searches),
            variant,
            "on" if remat else "off",
            batch,
            size / GiB,
            left,
            left * self.seconds / self.done / 60,
            self.seconds / self.done,
        )
        return size


def print_plan(
    config,
    variants,
    slice_names: str = "all",
    headroom: float = 0.9,
    estimate=step_bytes,
    compiler: str = "auto",
):
    """Checks the slices, headroom and config before compiling, plans (TPU slices by the TPU
    compiler where `by_tpu_compiler` says so) and prints the table."""
    slices = resolve_slices(slice_names)
    if not 0 < headroom <= 1:
        raise ConfigError(
            f"--headroom={headroom} must be in (0, 1]: the fraction of a device's memory to fill"
        )
    setup.validate_config(config)
    tpu, estimated = by_tpu_compiler(slices, compiler)
    rows = tpu_plan(config, variants, tpu, headroom) if tpu else []
    if estimated:
        rows += plan(config, variants, estimated, headroom, estimate)
    _print_rows(config, rows, headroom)
    return rows


def _print_rows(config, rows: list[Row], headroom: float) -> None:
    print(
        f"model {config.model_name}, compute dtype {config.compute_dtype}, {config.image_size} px, "
        f"global batch {config.batch_size}, sharding {config.sharding}; budget {headroom:g} of a "
        "device's memory; GiB: the memory of one device's step by the compiler named in the row"
    )
    print(
        f"{'slice':<8} {'devices':>7} {'GiB/dev':>7} {'step':<10} {'remat':<5} {'max micro':>9} "
        f"{'GiB':>8} {'per-device':>10} {'micro':>6} {'grad_accum_steps':>16} compiler"
    )
    for r in rows:
        largest = (
            f"<{MULTIPLE}" if not r.fit.batch else f"{r.fit.batch}{'' if r.fit.proven else '*'}"
        )
        per_device = config.batch_size // r.devices if config.batch_size % r.devices == 0 else "-"
        micro, steps = r.accumulation or ("-", "-")
        print(
            f"{r.slice:<8} {r.devices:>7} {r.device_bytes / GiB:>7.0f} {r.variant:<10} "
            f"{'on' if r.remat else 'off':<5} {largest:>9} {r.fit.bytes / GiB:>8.2f} "
            f"{per_device:>10} {micro:>6} {steps:>16} {r.compiler}"
        )
    print(
        f"max micro: the largest multiple of {MULTIPLE} that fits (<{MULTIPLE}: none; its GiB is "
        f"then the figure at {MULTIPLE}); micro: the largest divisor of the per-device batch up "
        "to it, run grad_accum_steps times per step; with grad_accum_steps > 1 the step also "
        "holds a float32 gradient sum the size of the parameters. TPU: the TPU compiler's own "
        "memory analysis for the slice's topology, the config's sharding over every chip and "
        "its remat (a program it refuses does not fit). XLA:CPU: an estimate on one device "
        "with remat off and on; the TPU/GPU compilers lay out, fuse and schedule otherwise, "
        "hence the headroom."
    )
    if any(not r.fit.proven for r in rows):
        print("*: the compile limit was reached before the next multiple was shown not to fit.")
    if config.sharding != "replicated" and any(r.compiler == "XLA:CPU" for r in rows):
        print(
            f"config.sharding={config.sharding}: XLA:CPU rows compile on one device, so a sharded "
            "state is counted whole (an upper bound when the slice shards it)."
        )
