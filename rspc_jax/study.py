"""The small-scale reproduction study: `python -m rspc_jax.study --config=configs/demo_study.py
--workdir=DIR [--settings=a,b] [--seeds=0,1] [--reevaluate=suite,...]` (rspc_jax.tools.study:
what it trains, evaluates and writes). `--settings` and `--seeds` run a long study in parts:
each part trains only its runs, and the report covers every setting and seed finished in DIR
so far. Suites added to the config since a run finished, and those named by `--reevaluate`,
are evaluated on its final checkpoint without training it again."""

import os
import sys

from absl import app, flags
from ml_collections import config_flags

from rspc_jax.tools import cli

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    os.path.join(os.path.dirname(__file__), "..", "configs", "demo_study.py"),
    "The study's config file (base run, config.study, config.evaluation).",
    lock_config=False,
)
_WORKDIR = cli.DEFINE_path("workdir", None, "Where the runs, results.md and figures go.")
_SETTINGS = flags.DEFINE_list(
    "settings", None, "Run only these settings of config.study.settings (a study in parts)."
)
_SEEDS = flags.DEFINE_list("seeds", None, "Run only these seeds (default: config.study.seeds).")
_REEVALUATE = flags.DEFINE_list(
    "reevaluate",
    None,
    "Suites to evaluate again on runs already finished (from their final checkpoints, without "
    "training); suites of config.evaluation.suites that a finished run lacks always are.",
)

_ACCEPT_CONFIG_CHANGE = flags.DEFINE_bool(
    "accept_config_change",
    False,
    "Resume unfinished runs although the config changes what they train; each change is "
    "recorded with its step (<run>/config_history.jsonl) and listed in results.md.",
)


def main(argv):
    if not _WORKDIR.value:
        raise app.UsageError("pass --workdir (where the study's runs and results go)")
    from rspc_jax.tools import study as study_runner

    config = cli.start(argv, _CONFIG.value)
    command = "python -m rspc_jax.study " + " ".join(sys.argv[1:])
    path = study_runner.run_study(
        config,
        _WORKDIR.value,
        command,
        settings=_SETTINGS.value,
        seeds=_SEEDS.value,
        reevaluate=_REEVALUATE.value,
        accept_config_change=_ACCEPT_CONFIG_CHANGE.value,
    )
    if path:
        print(f"Results: {path}", flush=True)


if __name__ == "__main__":
    cli.run(main)
