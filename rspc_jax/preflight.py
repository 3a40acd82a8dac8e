"""Pre-flight for the TPU slice you are about to rent:
`python -m rspc_jax.preflight --config=configs/<file>.py --slice=v5e-256`.

Compiles the config's exact train step (its batch split over every chip of the slice, its
sharding, grad_accum_steps, remat and dtype) and its evaluation step with the TPU compiler
for the slice's real topology, on this host, without a TPU (libtpu: requirements-tpu.txt),
and says whether each fits the chip's HBM with the per-chip figures; a step that does not
fit gets the fixes of the memory check before a run's first step. Exit 0 when both fit, 1
when not. launch/tpu_vm.sh runs it before it creates a slice (PREFLIGHT=0 skips it).
"""

from absl import flags
from ml_collections import config_flags

from rspc_jax import ReportedError
from rspc_jax.tools import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=False)
_SLICE = flags.DEFINE_string("slice", None, "TPU slice (accelerator type), e.g. v5e-256.")
_HEADROOM = flags.DEFINE_float(
    "headroom", 0.9, "The fraction of a chip's HBM the step may fill.", lower_bound=0.01
)


def main(argv):
    cli.start(argv)  # this host joins no slice: it only compiles for one
    from rspc_jax.tools import tpu_compile

    config = _CONFIG.value
    if config is None or _SLICE.value is None:
        raise ReportedError("pass --config=configs/<file>.py[:variant] and --slice=<TPU slice>")
    tpu = tpu_compile.check_slice(_SLICE.value)
    if not tpu_compile.available():
        raise ReportedError(
            "the pre-flight needs libtpu, the TPU compiler (no TPU): pip install -r "
            "requirements-tpu.txt"
        )
    tpu_compile.prepare_environment()
    from rspc_jax.tools import preflight_report

    if not preflight_report.run(config, _SLICE.value, tpu, _HEADROOM.value):
        raise SystemExit(1)


if __name__ == "__main__":
    cli.run(main)
