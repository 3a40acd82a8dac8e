"""Entry point: `python -m rspc_jax.main --config=configs/<file>.py[:arg] --workdir=DIR`.

Any config field can be overridden with `--config.<key>=<value>`. Rerunning the same
command resumes from the last checkpoint in `--workdir`; a rerun that changes what the run
trains is refused unless `--accept_config_change` (interop/run_record.py). The config's values and the
workdir are checked before JAX and TensorFlow are imported, so bad input fails at once.
"""

import os

from absl import flags
from ml_collections import config_flags

from rspc_jax.tools import cli
from rspc_jax.training import checks

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    os.path.join(os.path.dirname(__file__), "..", "configs", "demo.py"),
    "Config file (default: the embedded digits demo).",
    lock_config=True,
)
_WORKDIR = cli.DEFINE_path(
    "workdir",
    None,
    "Where checkpoints, metrics and the resolved config go (local path or "
    "gs://); rerunning with the same workdir resumes.",
    required=True,
)
_FORCE_UNLOCK = flags.DEFINE_bool(
    "force_unlock",
    False,
    "Take the workdir's lock (<workdir>/run.lock) even from a run that looks alive: only "
    "when you know that run is dead. Locks of dead runs on this host, and locks whose "
    "heartbeat stopped 10 minutes ago, are taken over without it.",
)

_ACCEPT_CONFIG_CHANGE = flags.DEFINE_bool(
    "accept_config_change",
    False,
    "Resume a run although this command changes what it trains (batch size, learning rate, "
    "model, data, schedule, length, ...): the change is recorded with its step in "
    "<workdir>/config_history.jsonl. Without it such a resume is refused, naming each change.",
)


def main(argv):
    checks.validate_config(_CONFIG.value)
    checks.check_workdir(_WORKDIR.value)
    # Orbax and clu log every save and scalar at INFO; progress goes to stdout instead.
    config = cli.start(argv, _CONFIG.value, libraries="warning")
    # Imported here so that --help and bad input stay fast and JAX starts after the checks.
    from rspc_jax.training import loop

    loop.train_and_evaluate(
        config,
        _WORKDIR.value,
        force_unlock=_FORCE_UNLOCK.value,
        accept_config_change=_ACCEPT_CONFIG_CHANGE.value,
    )


if __name__ == "__main__":
    cli.run(main)
