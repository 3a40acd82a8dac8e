"""Model-robustness analyses (Bhojanapalli et al., ICCV'21):
`python -m rspc_jax.analyze --config=configs/<file>.py --workdir=DIR --analysis=<names>`.

Analyses (comma-separated): layer_correlation, lesion, restricted_attention,
spatial_attack. Runs on the latest checkpoint of the run in `--workdir` (or `--step`, or
a PyTorch/safetensors file with `--checkpoint`), sharded over every device, and writes
JSON, figures and summary.md to `<workdir>/analysis` (or `--out`). Settings:
config.analysis.
"""

from absl import flags

from rspc_jax.tools import cli

_FLAGS = cli.define_checkpoint_flags("analyse", "analysis")
_ANALYSIS = flags.DEFINE_string(
    "analysis",
    "layer_correlation,lesion,restricted_attention,spatial_attack",
    "Comma-separated analyses.",
)


def main(argv):
    config = cli.start(argv, _FLAGS.config.value)
    from rspc_jax.evaluation import run_suites

    run_suites.run_analyses(config, analyses=_ANALYSIS.value, **_FLAGS.source())


if __name__ == "__main__":
    cli.run(main)
