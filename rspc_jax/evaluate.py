"""Robustness evaluation: `python -m rspc_jax.evaluate --config=configs/<file>.py --workdir=DIR`.

Evaluates the latest checkpoint of the training run in `--workdir` (or `--step`, or a
PyTorch/safetensors file with `--checkpoint`), sharded over every device and host, and
writes `<out>/<suite>.json`, `<out>/report.md` and `<out>/figures/*.png` (default out:
`<workdir>/eval`). Suites: `--suites=clean,corrupted_local,...` (default:
config.evaluation.suites); a suite that cannot run (missing data) is skipped with the
reason in the report, never a crash of the whole run.
"""

import os

from absl import app
from absl import flags
from ml_collections import config_flags

from rspc_jax import cli

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs", "demo.py"),
    "The run's config file (model, dataset, evaluation settings).", lock_config=False)
_WORKDIR = flags.DEFINE_string("workdir", None, "Training run whose checkpoint to evaluate; "
                               "results go to <workdir>/eval.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Evaluate this PyTorch/safetensors/npz "
                                  "checkpoint instead of the workdir's (rspc_jax.interop).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step of the workdir; default: latest.")
_EMA = flags.DEFINE_bool("ema", False, "Evaluate the EMA weights.")
_SUITES = flags.DEFINE_string("suites", None, "Comma-separated suites; default: "
                              "config.evaluation.suites.")
_OUT = flags.DEFINE_string("out", None, "Output directory; default <workdir>/eval.")


def main(argv):
    config = cli.start(argv, _CONFIG.value)
    from rspc_jax.evaluation import run

    run.evaluate(config, workdir=_WORKDIR.value, checkpoint=_CHECKPOINT.value,
                 step=_STEP.value, ema=_EMA.value, suites=_SUITES.value, out=_OUT.value)


if __name__ == "__main__":
    app.run(main)
