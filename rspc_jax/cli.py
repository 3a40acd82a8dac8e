"""What the checkpoint-reading CLIs (evaluate, analyze, study) do before their work."""

from absl import app
from absl import flags
from absl import logging


def start(argv, config):
    """Refuses stray arguments, quiets orbax (it logs every read) unless --verbosity was
    given, and joins jax.distributed on multi-host runs; returns the config."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    from rspc_jax import parallel

    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.ERROR)
    parallel.maybe_initialize_distributed(config.distributed)
    return config
