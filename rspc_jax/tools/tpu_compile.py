"""A config's train and evaluation steps compiled by the TPU compiler for a named TPU slice,
on any host: libtpu (the `jax[tpu]` extra, requirements-tpu.txt) compiles for a TPU topology
without owning one (`jax.experimental.topologies`), and its executable's memory analysis is
the TPU's own figure per chip, allocating nothing. `python -m rspc_jax.plan` sizes
micro-batches with it and `python -m rspc_jax.plan --preflight=SLICE` checks a config for the slice it is
about to rent.

The step is the one training runs: the models traced as for TPUs (`ops.for_backend`), the
config's sharding over every chip of the slice (data parallel or FSDP), its remat, dtype and
gradient accumulation, the state and batch abstract. The TPU compiler schedules and
rematerialises against the chip's HBM and refuses a program that does not fit
(RESOURCE_EXHAUSTED): that is a "does not fit" with the compiler's figure, not a crash.
"""

import functools
import importlib.util
import os
import re
import time
from typing import NamedTuple

import jax
from jax.sharding import Mesh
import numpy as np

from rspc_jax import ConfigError, models, parallel
from rspc_jax.data import specs as datasets
from rspc_jax.models import ops
from rspc_jax.training import setup
from rspc_jax.training.memory_check import compiled_bytes

GiB = 2**30


class TpuSlice(NamedTuple):
    topology: str  # jax.experimental.topologies' name: generation and chip grid
    chips: int  # JAX devices (v4, v5p: one per chip, their two TensorCores act as one)
    hosts: int
    hbm: int  # nominal HBM per chip in bytes (the runtime keeps a little: v5e 15.75 of 16 GiB)


def _slices() -> dict[str, TpuSlice]:
    """Cloud TPU slice names (accelerator types) -> their topology: v4 and v5p name
    TensorCores (two per chip), v5e and v6e name chips; 4 chips per host for v4/v5p, 8 per
    single-host v5e/v6e and 4 per host of their multi-host slices."""
    grids = {
        "v4": ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4"),
        "v5p": ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4"),
        "v5e": ("2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
        "v6e": ("2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
    }
    hbm = {"v4": 32, "v5p": 95, "v5e": 16, "v6e": 32}
    slices = {}
    for generation, shapes in grids.items():
        cores_per_chip = 2 if generation in ("v4", "v5p") else 1
        for grid in shapes:
            chips = int(np.prod([int(n) for n in grid.split("x")]))
            hosts = 1 if chips == 8 and cores_per_chip == 1 else max(1, chips // 4)
            name = f"{generation}-{chips * cores_per_chip}"
            slices[name] = TpuSlice(f"{generation}:{grid}", chips, hosts, hbm[generation] * GiB)
    return slices


SLICES = _slices()
# What the planner and the pre-flight name by default: one single-host slice per generation.
DEFAULT_SLICES = ("v4-8", "v5e-8", "v5p-8", "v6e-8")


def available() -> bool:
    """Whether libtpu, and so the TPU compiler, is importable here."""
    return importlib.util.find_spec("libtpu") is not None


def prepare_environment() -> None:
    """Set before JAX starts its backends: this process only compiles, so it runs on the CPU
    (sparing libtpu's start-up, even on a TPU VM) unless JAX_PLATFORMS says otherwise, shares
    libtpu with any other process (libtpu otherwise keeps one lock per machine), and names no
    TPU host of its own (libtpu warns without them)."""
    if "JAX_PLATFORMS" not in os.environ:
        jax.config.update("jax_platforms", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-8")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


def check_slice(name: str) -> TpuSlice:
    if name not in SLICES:
        raise ConfigError(
            f"unknown TPU slice {name!r}: name a Cloud TPU accelerator type, one of "
            f"{', '.join(SLICES)}"
        )
    return SLICES[name]


@functools.cache
def mesh(name: str) -> Mesh:
    """A data mesh over every chip of slice `name`, as the TPU compiler sees it."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        topology_name=check_slice(name).topology, platform="tpu"
    )
    return Mesh(np.asarray(topology.devices), (parallel.DATA_AXIS,))


class Compiled(NamedTuple):
    """The TPU compiler's answer for one step on one slice, per chip."""

    fits: bool  # compiled, and its bytes within the budget
    bytes: int  # compiled_bytes; for a refused program, what the compiler said it needs
    seconds: float  # compile wall time
    refusal: str  # the compiler's RESOURCE_EXHAUSTED message, else ''
    analysis: object = None  # memory_analysis() of a compiled program
    executable: object = None  # the compiled program (as_text(), cost_analysis())


_NEEDS = re.compile(r"required for [^(]*\(([\d.]+)([GMK])\)")


def refused_bytes(message: str) -> int:
    """The bytes a RESOURCE_EXHAUSTED message says the program needs (its largest figure)."""
    scale = {"G": GiB, "M": 2**20, "K": 2**10}
    found = [float(n) * scale[u] for n, u in _NEEDS.findall(message)]
    return int(max(found)) if found else 0


def _compile(lower, budget: float) -> Compiled:
    start = time.perf_counter()
    try:
        compiled = lower().compile()
    except jax.errors.JaxRuntimeError as error:
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        message = str(error).split("\n")[0]
        return Compiled(False, refused_bytes(message), time.perf_counter() - start, message)
    size = compiled_bytes(compiled)
    seconds = time.perf_counter() - start
    return Compiled(size <= budget, size, seconds, "", compiled.memory_analysis(), compiled)


# (slice, per-chip batch, the config as JSON) -> Compiled: a search and a later check of the
# same step (the planner's, a test's) share each compile, which takes minutes at full size.
_TRAIN_STEPS: dict = {}


def train_step(config, name: str, per_chip_batch: int, headroom: float = 0.9) -> Compiled:
    """The config's train step (its sharding, remat, dtype, grad_accum_steps) for slice
    `name` at `per_chip_batch` images per chip, compiled by the TPU compiler (once per
    process for the same step and batch; `fits` is judged against this `headroom`)."""
    tpu = check_slice(name)
    config = config.copy_and_resolve_references()
    config.batch_size = per_chip_batch * tpu.chips
    key = (name, per_chip_batch, config.to_json(sort_keys=True))
    if key not in _TRAIN_STEPS:
        _TRAIN_STEPS[key] = _compile_train_step(config, name)
    found = _TRAIN_STEPS[key]
    return found._replace(fits=not found.refusal and found.bytes <= headroom * tpu.hbm)


def _compile_train_step(config, name: str) -> Compiled:
    the_mesh = mesh(name)
    spec = datasets.dataset_spec(config.dataset)
    with ops.for_backend("tpu"):
        model = setup.build_model(config, spec.num_classes)
        parts = setup.build(config, model, spec, the_mesh, steps_per_epoch=1000, total_steps=1000)
        batch = setup.abstract_batch(the_mesh, config.batch_size, config)
        return _compile(lambda: parts.train_step.lower(parts.state_shapes, batch), float("inf"))


def eval_step(config, name: str, per_chip_batch: int, headroom: float = 0.9) -> Compiled:
    """The clean evaluation step (training's periodic evaluation, the suites' accuracy) for
    slice `name` at `per_chip_batch` images per chip."""
    from rspc_jax.evaluation import loop as runner
    from rspc_jax.evaluation import run_suites

    tpu = check_slice(name)
    the_mesh = mesh(name)
    spec = datasets.dataset_spec(config.dataset)
    with ops.for_backend("tpu"):
        model = setup.build_model(config, spec.num_classes)
        ctx = run_suites.build_context(
            config, model, mesh=the_mesh, compute_dtype=setup.compute_dtype(config)
        )
        step = runner.accuracy_step(ctx)
        replicated = parallel.replicated(the_mesh)
        variables = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
            models.abstract_variables(model, config.image_size),
        )
        batch = _abstract_eval_batch(the_mesh, per_chip_batch * tpu.chips, config.image_size)
        key = jax.ShapeDtypeStruct((2,), np.uint32, sharding=replicated)
        return _compile(lambda: step.lower(variables, batch, key), headroom * tpu.hbm)


def _abstract_eval_batch(the_mesh: Mesh, batch: int, image_size: int) -> dict:
    sharding = parallel.batch_sharded(the_mesh)
    shapes = dict(
        image=((batch, image_size, image_size, 3), np.float32),
        label=((batch,), np.int32),
        mask=((batch,), np.float32),
    )
    return {k: jax.ShapeDtypeStruct(s, d, sharding=sharding) for k, (s, d) in shapes.items()}
