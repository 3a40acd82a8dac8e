"""The largest per-device micro-batch of a config's train step that fits each slice's device
memory, and the grad_accum_steps that then reach the config's global batch: how to size a
run before renting the slice.

    python -m rspc_jax.plan --config=configs/rvt_s.py --config.compute_dtype=bfloat16
    python -m rspc_jax.plan --config=configs/rvt_ti.py --variants=rspc --slices=v3-8,v4-8

It runs no step: for each variant it compiles the step at a few micro-batches and keeps the
largest that fits `--headroom` of a device's memory. TPU slices (v4-8 ... v4-128, v5e-8 ...
v5e-256, v5p-8 ..., v6e-8 ...) are compiled by the TPU compiler where libtpu is installed
(requirements-tpu.txt; no TPU needed) for the slice's real topology, with the config's
sharding over every chip and its remat: the TPU's own per-chip figure, minutes per compile on
a CPU. GPUs, v3 and hosts without libtpu get XLA:CPU's estimate on one device, remat off and
on (rspc_jax.tools.memory_plan says what it is and is not). Each row names its compiler.

    python -m rspc_jax.plan --config=configs/rvt_s.py --config.compute_dtype=bfloat16 \
        --slices=v5e-8 --variants=rspc

`--preflight=SLICE` instead checks the config as it stands for the TPU slice you are about to
rent: its exact train step (its batch over every chip, sharding, grad_accum_steps, remat,
dtype) and evaluation step, compiled by the TPU compiler for the slice's topology; fits / does
not fit per chip with the figures, and the memory check's fixes for a step that does not fit.
Exit 0 when both fit, 1 when not. launch/tpu_vm.sh runs it before it creates a slice.

    python -m rspc_jax.plan --config=configs/rvt_b.py --preflight=v5e-256
"""

import os

from absl import app, flags
from ml_collections import config_flags

from rspc_jax.tools import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=False)
_BATCH = flags.DEFINE_integer("batch", 0, "Global batch size (0 = the config's).")
_VARIANTS = flags.DEFINE_string(
    "variants",
    "plain,rspc",
    "Comma-separated step variants: plain, rspc or names of rspc_jax.training.ablations.",
)
_SLICES = flags.DEFINE_string(
    "slices",
    "all",
    "Comma-separated slices (v3-8, v4-8, v5e-8, v5p-8, h100, a100-40, a100-80) or 'all'.",
)
_COMPILER = flags.DEFINE_enum(
    "compiler",
    "auto",
    ["auto", "tpu", "xla_cpu"],
    "Who measures TPU slices: 'auto' the TPU compiler where libtpu is installed, else XLA:CPU; "
    "'tpu' the TPU compiler or an error; 'xla_cpu' XLA:CPU's estimate.",
)
_PREFLIGHT = flags.DEFINE_string(
    "preflight", None, "A TPU slice (e.g. v5e-256): check the config as it stands for it."
)
_HEADROOM = flags.DEFINE_float(
    "headroom", 0.9, "The fraction of a device's memory the step may fill."
)


def main(argv):
    cli.start(argv)
    from rspc_jax.tools import memory_plan, tpu_compile

    config = _CONFIG.value
    if config is None:
        raise app.UsageError("pass --config=configs/<file>.py[:variant]")
    if _BATCH.value:
        config.batch_size = _BATCH.value
    if _PREFLIGHT.value:
        return _preflight(config, _PREFLIGHT.value)
    variants = _VARIANTS.value.split(",")
    memory_plan.check_variants(variants)
    tpu, estimated = memory_plan.by_tpu_compiler(
        memory_plan.resolve_slices(_SLICES.value), _COMPILER.value
    )
    # Before JAX starts its backend: the TPU compiler's environment, and XLA:CPU's flags
    # (memory_plan.XLA_FLAGS says why) only where XLA:CPU estimates.
    if tpu:
        tpu_compile.prepare_environment()
    if estimated:
        flags_now = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags_now} {memory_plan.XLA_FLAGS}".strip()
    memory_plan.print_plan(
        config, variants, _SLICES.value, _HEADROOM.value, compiler=_COMPILER.value
    )


def _preflight(config, name: str):
    from rspc_jax import ReportedError
    from rspc_jax.tools import preflight_report, tpu_compile

    tpu = tpu_compile.check_slice(name)
    if not tpu_compile.available():
        raise ReportedError(
            "--preflight needs libtpu, the TPU compiler (no TPU): pip install -r "
            "requirements-tpu.txt"
        )
    tpu_compile.prepare_environment()
    if not preflight_report.run(config, name, tpu, _HEADROOM.value):
        raise SystemExit(1)


if __name__ == "__main__":
    cli.run(main)
