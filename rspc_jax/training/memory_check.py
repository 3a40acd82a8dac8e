"""Whether the compiled train step fits the memory it will run in, said before the first step.

A step that does not fit ends, without this, in the kernel's OOM killer on CPU (exit 137, no
word why; a machine without a limit swaps itself to a halt first) or in XLA's RESOURCE_EXHAUSTED
with its allocation dump on accelerators. The loop compiles the step ahead of the first call
anyway; XLA's memory analysis of that program (`compiled_bytes`: arguments, outputs and
temporaries) is compared here with the memory the step can have: the device's limit
(`memory_stats()['bytes_limit']`) on accelerators, on CPU what the process can still take (the
machine's available memory and its cgroups' room) plus the state it holds already. A step that
does not fit stops the run with one paragraph: the numbers and the fixes, cheapest first
(`fixes`). The same paragraph replaces XLA's RESOURCE_EXHAUSTED when the estimate was wrong.

`config.memory_check=False` runs anyway; the environment variable RSPC_JAX_MEMORY_LIMIT_GIB
sets the limit instead of measuring it (a budget below the machine's, and the tests).
"""

import dataclasses
import os
import shlex
import sys

from absl import logging
import jax

from rspc_jax import ConfigError, ReportedError, models

GiB = 2**30
LIMIT_ENV = "RSPC_JAX_MEMORY_LIMIT_GIB"
# The share of the limit kept free: a step fits when XLA's estimate is at most 95% of it. The
# estimate is XLA's plan, not a measurement; the allocator, the input pipeline and the
# evaluation take more (docs/faults.md, "Out of memory, said before the first step", has the
# run just over the limit that was killed).
MARGIN = 0.05
_NO_LIMIT = 2**60  # cgroup v1 writes "no limit" as a number near 2**63


class OutOfMemoryError(ReportedError, MemoryError):
    """The train step needs more memory than the device (or this process on CPU) has."""


def compiled_bytes(compiled) -> int:
    """XLA's estimate of one device's memory for a compiled step: arguments, outputs and
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


@dataclasses.dataclass(frozen=True)
class Footprint:
    """One device's share of the compiled train step, in bytes, and what it is for, so that
    other micro-batches can be estimated: activations (temporaries beyond the gradients) grow
    with the micro-batch, the state, the batch and the gradients do not."""

    estimate: int  # compiled_bytes of the step
    temporaries: int  # XLA's temporaries (activations, gradients, the accumulated sum)
    param_bytes: int  # the classifier's parameters on one device (their gradients' size)
    param_count: int  # the classifier's parameters
    per_device: int  # images per device per step
    accum_steps: int  # micro-batches per step (config.grad_accum_steps)

    @property
    def micro_batch(self) -> int:
        return self.per_device // self.accum_steps

    def _gradient_bytes(self, accum_steps: int) -> int:
        """Gradients of one micro-batch, and with accumulation their float32 sum too."""
        return self.param_bytes * (2 if accum_steps > 1 else 1)

    def at(self, accum_steps: int) -> int:
        """The estimate with `accum_steps` micro-batches per step (the same global batch)."""
        activations = max(self.temporaries - self._gradient_bytes(self.accum_steps), 0)
        per_image = activations / self.micro_batch
        fixed = self.estimate - self.temporaries + self._gradient_bytes(accum_steps)
        return int(fixed + per_image * (self.per_device // accum_steps))


def footprint(config, programs: list, state) -> Footprint:
    """The Footprint of the largest of the compiled step `programs` (one step; several steps
    per call) for `state` (arrays or their shapes)."""
    compiled = max(programs, key=compiled_bytes)
    analysis = compiled.memory_analysis()
    leaves = jax.tree.leaves(state.params)
    params = sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)
    shards = jax.device_count() if config.sharding == "fsdp" else 1
    return Footprint(
        estimate=compiled_bytes(compiled),
        temporaries=analysis.temp_size_in_bytes if analysis is not None else 0,
        param_bytes=params // shards,
        param_count=sum(leaf.size for leaf in leaves),
        per_device=config.batch_size // jax.device_count(),
        accum_steps=config.grad_accum_steps,
    )


@dataclasses.dataclass(frozen=True)
class Limit:
    """The memory one device's step may take (bytes), and where the number comes from."""

    bytes: int
    source: str


def limit(resident: int) -> Limit | None:
    """One device's memory limit for the step: RSPC_JAX_MEMORY_LIMIT_GIB if set; an
    accelerator's `bytes_limit`; on CPU the memory this process can still take plus the
    `resident` bytes of the step's arguments (state and batches on all of this host's
    devices) that it holds already, shared by the host's devices. None where unknown."""
    forced = os.environ.get(LIMIT_ENV)
    if forced:
        return Limit(int(_forced_gib(forced) * GiB), f"{LIMIT_ENV}={forced}")
    device = jax.local_devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if "bytes_limit" not in stats:
            return None
        return Limit(stats["bytes_limit"], f"the memory of one {device.device_kind}")
    available = host_available_bytes()
    if available is None:
        return None
    devices = jax.local_device_count()
    return Limit(
        (available + resident) // devices,
        "the memory this process can still take: the machine's available memory and its "
        "cgroup limit"
        + (f", plus the {resident / GiB:.1f} GiB of state it holds already" if resident else "")
        + (f", shared by {devices} CPU devices" if devices > 1 else ""),
    )


def _forced_gib(value: str) -> float:
    """The GiB of RSPC_JAX_MEMORY_LIMIT_GIB, refused in a paragraph unless a number > 0."""
    try:
        gib = float(value)
    except ValueError:
        gib = 0.0
    if not gib > 0:
        raise ConfigError(
            f"{LIMIT_ENV}={value!r} is not a number of GiB > 0: set it to the memory one "
            "device's step may take (e.g. 6), or unset it to measure the device's."
        )
    return gib


def host_available_bytes() -> int | None:
    """What this process can still allocate: the smaller of the machine's MemAvailable and
    the room its cgroups (v2 memory.max, v1 memory.limit_in_bytes, and their parents') leave
    above their usage, page cache that can be dropped not counted. None off Linux."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
    except OSError:
        return None
    available = int(fields["MemAvailable"].split()[0]) * 1024
    return min([available, *_cgroup_rooms()])


def _cgroup_rooms() -> list[int]:
    """Limit minus usage (less inactive page cache) of each memory cgroup above this process."""
    rooms = []
    for directory, limit_file, usage_file, cache_key in _cgroup_directories():
        limit_bytes = _read_int(os.path.join(directory, limit_file))
        usage = _read_int(os.path.join(directory, usage_file))
        if limit_bytes is None or usage is None or limit_bytes >= _NO_LIMIT:
            continue
        cache = _memory_stat(directory).get(cache_key, 0)
        rooms.append(limit_bytes - (usage - cache))
    return rooms


def _cgroup_directories() -> list[tuple]:
    """(directory, limit file, usage file, inactive cache key) of this process's memory
    cgroup and each parent up to the mount, under v2 ('0::/path') and v1 ('N:memory:/path').
    Inside a container the mount shows only the tail of the path, so the longest tail that
    exists is taken."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return []
    found = []
    for _, controllers, path in lines:
        if controllers == "" and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            mount, files = "/sys/fs/cgroup", ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            mount = "/sys/fs/cgroup/memory"
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        tails = [parts[i:] for i in range(len(parts) + 1)]
        tail = next((t for t in tails if os.path.isdir(os.path.join(mount, *t))), None)
        while tail is not None:
            found.append((os.path.join(mount, *tail), *files))
            tail = tail[:-1] if tail else None
    return found


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):  # absent, or v2's "max"
        return None


def _memory_stat(directory: str) -> dict:
    try:
        with open(os.path.join(directory, "memory.stat")) as f:
            return {k: int(v) for k, v in (line.split() for line in f)}
    except (OSError, ValueError):
        return {}


def fits(estimate: int, step_limit: Limit) -> bool:
    """Whether a step of `estimate` bytes fits `step_limit`, MARGIN of it kept free."""
    return estimate <= step_limit.bytes * (1 - MARGIN)


def refusal(config, found: Footprint, step_limit: Limit) -> OutOfMemoryError:
    """The paragraph of a step that does not fit, before anything ran."""
    return OutOfMemoryError(
        f"the train step does not fit in memory: it needs about {found.estimate / GiB:.2f} GiB "
        f"per device (XLA's estimate of the compiled step: state, batch, outputs and "
        f"temporaries) and the limit is {step_limit.bytes / GiB:.2f} GiB "
        f"({step_limit.source}). {_run_words(config, found)} Nothing was trained or saved. "
        f"{fixes(config, found, step_limit)} --config.memory_check=False runs it anyway."
    )


def ran_out(config, found: Footprint | None, step_limit: Limit | None, cause, resume: str):
    """The paragraph of XLA's RESOURCE_EXHAUSTED (`cause`) at compile or at a step; `found`
    is None when the step did not compile."""
    first_line = str(cause).strip().splitlines()[0][:300]
    estimate = (
        f"XLA's estimate of the step was {found.estimate / GiB:.2f} GiB per device"
        + (f" and the limit {step_limit.bytes / GiB:.2f} GiB" if step_limit else "")
        + ", so the estimate was short. "
        if found
        else ""
    )
    found = found or _unknown_footprint(config)
    return OutOfMemoryError(
        f"the device ran out of memory ({first_line}). {estimate}{_run_words(config, found)} "
        f"{resume}; nothing of the failed step was saved. {fixes(config, found, step_limit)}"
    )


def _unknown_footprint(config) -> Footprint:
    per_device = config.batch_size // jax.device_count()
    return Footprint(0, 0, 0, 0, per_device, config.grad_accum_steps)


def _run_words(config, found: Footprint) -> str:
    return (
        f"The run: {config.model_name}"
        + (f" ({found.param_count:,} parameters)" if found.param_count else "")
        + f" at {config.image_size} px, batch_size "
        f"{config.batch_size} ({found.per_device} images per device, in "
        f"{found.accum_steps} micro-batch{'es' if found.accum_steps > 1 else ''} of "
        f"{found.micro_batch}), compute_dtype {config.compute_dtype}, RSPC "
        f"{'on' if config.rspc.enabled else 'off'}."
    )


def fixes(config, found: Footprint, step_limit: Limit | None, devices: int = 0) -> str:
    """The fixes, cheapest first: accumulation (with the micro-batch it keeps and its
    estimate), FSDP over the `devices` (default: this process's), remat, a smaller batch, and
    the planner's command."""
    devices = devices or jax.device_count()
    steps = [_accumulation(config, found, step_limit)]
    if devices > 1 and config.sharding != "fsdp":
        steps.append(
            f"--config.sharding=fsdp shards the parameters and optimizer state over the "
            f"{devices} devices"
        )
    model = models.from_config(config, num_classes=1)
    if not config.remat and models.has_field(model, "remat"):
        steps.append("--config.remat=True recomputes each block's activations in the backward pass")
    steps.append(
        "a smaller --config.batch_size (which changes the recipe: the learning rate scales with it)"
    )
    steps.append(f"`{_plan_command()}` sizes the micro-batch for each TPU/GPU slice")
    return "The fixes, cheapest first: " + "; ".join(s for s in steps if s) + "."


def _accumulation(config, found: Footprint, step_limit: Limit | None) -> str:
    """The fewest micro-batches per step whose estimate fits, or why none does."""
    if not found.estimate or step_limit is None:
        return (
            "more micro-batches per step (--config.grad_accum_steps=N, N dividing the "
            f"{found.per_device} images per device)"
        )
    divisors = [n for n in range(1, found.per_device + 1) if found.per_device % n == 0]
    for n in divisors:
        if n > found.accum_steps and fits(found.at(n), step_limit):
            return (
                f"--config.grad_accum_steps={n} (micro-batches of {found.per_device // n} "
                f"images per device; the global batch of {config.batch_size} stays): about "
                f"{found.at(n) / GiB:.2f} GiB"
            )
    smallest = found.at(found.per_device)
    return (
        f"no micro-batch fits: even one image per micro-step "
        f"(--config.grad_accum_steps={found.per_device}) needs about {smallest / GiB:.2f} "
        "GiB, mostly the parameters, their gradients and the optimizer state, so take a "
        "smaller model (config.model) or shard them over several devices "
        "(config.sharding='fsdp')"
    )


def _plan_command() -> str:
    """`python -m rspc_jax.plan` with this command's --config flags (or a placeholder)."""
    configs = [a for a in sys.argv[1:] if a.startswith("--config")]
    flags = shlex.join(configs) if configs else "--config=<the run's config file>"
    return f"python -m rspc_jax.plan {flags}"


def is_resource_exhausted(error: BaseException) -> bool:
    """Whether `error` is XLA's out-of-memory error (at compile or at a step)."""
    return isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error)


def log_fit(found: Footprint, step_limit: Limit | None) -> None:
    if step_limit is None:
        logging.info(
            "Train step: %.2f GiB per device (XLA's estimate); no memory limit known to check",
            found.estimate / GiB,
        )
        return
    logging.info(
        "Train step: %.2f GiB per device (XLA's estimate) of a limit of %.2f GiB",
        found.estimate / GiB,
        step_limit.bytes / GiB,
    )
