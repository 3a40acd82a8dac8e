"""The largest per-device micro-batch of a config's train step that fits each slice's device
memory, and the grad_accum_steps that then reach the config's global batch: how to size a
run before renting the slice.

    python -m rspc_jax.plan --config=configs/rvt_s.py --config.compute_dtype=bfloat16
    python -m rspc_jax.plan --config=configs/rvt_ti.py --variants=rspc --slices=v3-8,v4-8

It runs no step: for each variant, with remat off and on, it compiles the step at a few
micro-batches (XLA's memory analysis, compiled by XLA:CPU on this machine, a few compiles
each) and keeps the largest that fits `--headroom` of a device's memory
(rspc_jax.tools.memory_plan says what the estimate is and is not).
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
_HEADROOM = flags.DEFINE_float(
    "headroom", 0.9, "The fraction of a device's memory the step may fill."
)


def main(argv):
    cli.start(argv)
    from rspc_jax.tools import memory_plan

    config = _CONFIG.value
    if config is None:
        raise app.UsageError("pass --config=configs/<file>.py[:variant]")
    if _BATCH.value:
        config.batch_size = _BATCH.value
    variants = _VARIANTS.value.split(",")
    memory_plan.check_variants(variants)
    memory_plan.resolve_slices(_SLICES.value)
    # Before JAX starts its backend (memory_plan.XLA_FLAGS says why).
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {memory_plan.XLA_FLAGS}".strip()
    memory_plan.print_plan(config, variants, _SLICES.value, _HEADROOM.value)


if __name__ == "__main__":
    cli.run(main)
