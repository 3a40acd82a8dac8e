"""What the checkpoint-reading CLIs (evaluate, analyze, study) share: the flags that name
the weights to read, and what they do before their work."""

import dataclasses
import logging as std_logging
import os

from absl import app, flags, logging
from ml_collections import config_flags


@dataclasses.dataclass(frozen=True)
class CheckpointFlags:
    """The flags naming a run's config and the weights to read."""

    config: flags.FlagHolder
    workdir: flags.FlagHolder
    checkpoint: flags.FlagHolder
    step: flags.FlagHolder
    ema: flags.FlagHolder
    out: flags.FlagHolder

    def source(self) -> dict:
        """Keyword arguments of evaluation.run_suites.run_suites / evaluation.analysis.run_analyses.run_analyses."""
        return dict(
            workdir=self.workdir.value,
            checkpoint=self.checkpoint.value,
            step=self.step.value,
            ema=self.ema.value,
            out=self.out.value,
        )


def define_checkpoint_flags(verb: str, out_dir: str) -> CheckpointFlags:
    """--config, --workdir, --checkpoint, --step, --ema, --out for a CLI that `verb`s
    (e.g. 'evaluate') a run's weights and writes to <workdir>/`out_dir` by default."""
    return CheckpointFlags(
        config=config_flags.DEFINE_config_file(
            "config",
            os.path.join(os.path.dirname(__file__), "..", "configs", "demo.py"),
            "The run's config file (model, dataset, settings).",
            lock_config=False,
        ),
        workdir=flags.DEFINE_string(
            "workdir",
            None,
            f"Training run whose checkpoint to {verb}; results go to <workdir>/{out_dir}.",
        ),
        checkpoint=flags.DEFINE_string(
            "checkpoint",
            None,
            f"{verb.capitalize()} this PyTorch/"
            "safetensors/npz checkpoint instead of the workdir's "
            "(rspc_jax.interop.state_dicts).",
        ),
        step=flags.DEFINE_integer("step", None, "Checkpoint step of the workdir; default: latest."),
        ema=flags.DEFINE_bool("ema", False, f"{verb.capitalize()} the EMA weights."),
        out=flags.DEFINE_string("out", None, f"Output directory; default <workdir>/{out_dir}."),
    )


class _OursOrAtLeast(std_logging.Filter):
    """Passes this package's records, and other records from `level` up."""

    def __init__(self, level: str):
        super().__init__()
        self.level = std_logging.getLevelName(level.upper())

    def filter(self, record) -> bool:
        return record.levelno >= self.level or _PACKAGE_DIR in record.pathname


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start(argv, config=None, libraries: str = "error"):
    """Refuses stray arguments; unless --verbosity was given, logs our messages from INFO
    up and other libraries' (orbax logs every save and read, clu every scalar) from
    `libraries` ("warning", "error") up; joins jax.distributed on multi-host runs of `config`; returns it."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    from rspc_jax import parallel

    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.INFO)
        logging.get_absl_handler().addFilter(_OursOrAtLeast(libraries))
    if config is not None:
        parallel.maybe_initialize_distributed(config.distributed)
    return config
