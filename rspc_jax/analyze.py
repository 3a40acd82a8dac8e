"""Model-robustness analyses (Bhojanapalli et al., ICCV'21):
`python -m rspc_jax.analyze --config=configs/<file>.py --workdir=DIR --analysis=<names>`.

Analyses (comma-separated): layer_correlation, lesion, restricted_attention,
spatial_attack. Runs on the latest checkpoint of the run in `--workdir` (or `--step`, or
a PyTorch/safetensors file with `--checkpoint`), sharded over every device, and writes
JSON, figures and summary.md to `<workdir>/analysis` (or `--out`). Settings:
config.analysis.
"""

import os

from absl import app
from absl import flags
from ml_collections import config_flags

from rspc_jax import cli

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs", "demo.py"),
    "The run's config file (model, dataset, analysis settings).", lock_config=False)
_WORKDIR = flags.DEFINE_string("workdir", None, "Training run whose checkpoint to analyse; "
                               "results go to <workdir>/analysis.")
_ANALYSIS = flags.DEFINE_string(
    "analysis", "layer_correlation,lesion,restricted_attention,spatial_attack",
    "Comma-separated analyses.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Analyse this PyTorch/safetensors/npz "
                                  "checkpoint instead of the workdir's (rspc_jax.interop).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step of the workdir; default: latest.")
_EMA = flags.DEFINE_bool("ema", False, "Analyse the EMA weights.")
_OUT = flags.DEFINE_string("out", None, "Output directory; default <workdir>/analysis.")


def main(argv):
    config = cli.start(argv, _CONFIG.value)
    from rspc_jax.analysis import run

    run.analyze(config, analyses=_ANALYSIS.value, workdir=_WORKDIR.value,
                checkpoint=_CHECKPOINT.value, step=_STEP.value, ema=_EMA.value, out=_OUT.value)


if __name__ == "__main__":
    app.run(main)
