"""Entry point: `python -m rspc_jax.main --config=configs/<file>.py[:arg] --workdir=DIR`.

Any config field can be overridden with `--config.<key>=<value>`. Rerunning the same
command resumes from the last checkpoint in `--workdir`.
"""

import os

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs", "demo.py"),
    "Config file (default: the embedded digits demo).", lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Where checkpoints, metrics and the resolved config go (local path or "
    "gs://); rerunning with the same workdir resumes.", required=True)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    # Imported here so that --help stays fast and JAX starts after flag parsing.
    from rspc_jax import parallel
    from rspc_jax import train

    if not flags.FLAGS["verbosity"].present:
        # Orbax and clu log every save and scalar at INFO; progress goes to stdout instead.
        logging.set_verbosity(logging.WARNING)
    config = _CONFIG.value
    parallel.maybe_initialize_distributed(config.distributed)
    train.train_and_evaluate(config, _WORKDIR.value)


if __name__ == "__main__":
    app.run(main)
