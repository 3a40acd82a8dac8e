"""Device mesh, multi-host start-up and host -> global batch assembly.

We use `jax.shard_map` under `jax.jit` on a 1-D `Mesh` of every device (all hosts):
the step is written per device with explicit collectives, as with pmap, but inputs
and state are global `jax.Array`s, which orbax and multi-host input need directly.
"""

import collections
from collections.abc import Iterator
import os

from absl import logging
import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from rspc_jax import ConfigError

DATA_AXIS = "data"


def maybe_initialize_distributed(mode: str = "auto") -> None:
    """Starts `jax.distributed` on multi-host runs.

    'auto' initialises when a coordinator is given in the environment
    (JAX_COORDINATOR_ADDRESS, with JAX_NUM_PROCESSES / JAX_PROCESS_ID) or on a
    multi-worker TPU VM slice (TPU_WORKER_HOSTNAMES lists several hosts); 'yes' always
    (TPU pods auto-detect their peers); 'no' never.
    """
    if mode not in ("auto", "yes", "no"):
        raise ValueError(f"distributed must be 'auto', 'yes' or 'no', got {mode!r}")
    coordinator = os.environ.get("JAX_COORDINATOR_ADDRESS")
    tpu_pod = "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")
    if mode == "no" or (mode == "auto" and not (coordinator or tpu_pod)):
        return
    kwargs = {}
    if coordinator:
        kwargs = dict(
            coordinator_address=coordinator,
            num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["JAX_PROCESS_ID"]),
        )
    jax.distributed.initialize(**kwargs)
    logging.info("jax.distributed: process %d of %d", jax.process_index(), jax.process_count())


def create_mesh() -> Mesh:
    """1-D data-parallel mesh over all devices; `Mesh(...)` gives Auto axes (not Explicit)."""
    return Mesh(np.asarray(jax.devices()), (DATA_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharded(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(DATA_AXIS))


def check_batch_size(global_batch: int, what: str = "batch_size") -> None:
    devices, hosts = jax.device_count(), jax.process_count()
    if global_batch % devices:
        raise ConfigError(
            f"global {what}={global_batch} is not divisible by the {devices} devices; "
            f"use a multiple of {devices}"
        )
    if global_batch % hosts:
        raise ConfigError(f"global {what}={global_batch} is not divisible by {hosts} hosts")


def to_global(local_batch: dict, mesh: Mesh) -> dict:
    """Assembles each host's slice of the batch into global arrays sharded over devices."""
    sharding = batch_sharded(mesh)
    return {
        k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
        for k, v in local_batch.items()
    }


def prefetch_to_mesh(iterator: Iterator[dict], mesh: Mesh, size: int = 2) -> Iterator[dict]:
    """Keeps `size` global batches in flight so host input overlaps device compute."""
    queue = collections.deque()
    for local_batch in iterator:
        queue.append(to_global(local_batch, mesh))
        if len(queue) > size:
            yield queue.popleft()
    while queue:
        yield queue.popleft()
