"""Robustness evaluation: `python -m rspc_jax.evaluate --config=configs/<file>.py --workdir=DIR`.

Evaluates the latest checkpoint of the training run in `--workdir` (or `--step`, or a
PyTorch/safetensors file with `--checkpoint`), sharded over every device and host, and
writes `<out>/<suite>.json`, `<out>/report.md` and `<out>/figures/*.png` (default out:
`<workdir>/eval`). Suites: `--suites=clean,corrupted_local,...` (default:
config.evaluation.suites); a suite that cannot run (missing data) is skipped with the
reason in the report, never a crash of the whole run.
"""

from absl import flags

from rspc_jax.tools import cli

_FLAGS = cli.define_checkpoint_flags("evaluate", "eval")
_SUITES = flags.DEFINE_string(
    "suites", None, "Comma-separated suites; default: config.evaluation.suites."
)


def main(argv):
    config = cli.start(argv, _FLAGS.config.value)
    from rspc_jax.evaluation import run_suites

    run_suites.run_suites(config, suites=_SUITES.value, **_FLAGS.source())


if __name__ == "__main__":
    cli.run(main)
