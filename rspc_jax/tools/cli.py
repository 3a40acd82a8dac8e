"""What the command-line tools share: `run` (flag parsing, the allocator, one-paragraph
errors), `start` (logging, jax.distributed), and the flags that name the weights the
checkpoint-reading tools (evaluate, analyze, study) read. Light on purpose: nothing here
imports JAX or TensorFlow, so bad flags and configs fail in a second."""

import ast
from collections.abc import Callable
import dataclasses
import glob
import importlib.util
import logging as std_logging
import os
import sys
import textwrap
import traceback

from absl import app, flags, logging
from ml_collections import config_flags

from rspc_jax import ReportedError, resolve_path
from rspc_jax.tools import allocator

_VERBOSE = flags.DEFINE_bool(
    "verbose", False, "On a reported error (bad config, missing file, ...) print the traceback too."
)
_MALLOC = flags.DEFINE_enum(
    "malloc",
    "tcmalloc",
    ["tcmalloc", "system"],
    "Memory allocator: 'tcmalloc' restarts the tool once with the system's tcmalloc preloaded "
    "where it is installed (faster steps on CPU: docs/speed.md, 'CPU: tcmalloc'); 'system' "
    "keeps the C library's.",
)


class _PathParser(flags.ArgumentParser):
    """A path flag's value as `rspc_jax.resolve_path` makes it: `runs/demo`, `~/runs/demo`,
    `/abs/runs/demo` and `gs://bucket/runs/demo` all work, from wherever the tool is run."""

    def parse(self, argument):
        return resolve_path(argument)

    def flag_type(self) -> str:
        return "path"


def DEFINE_path(name: str, default: str | None, help: str, **kwargs) -> flags.FlagHolder:
    """A string flag holding a file or folder path, resolved when parsed (`_PathParser`)."""
    return flags.DEFINE(
        _PathParser(), name, default, help, serializer=flags.ArgumentSerializer(), **kwargs
    )


# The config's fields that hold paths (config.evaluation's `*_dir` fields and these too).
_CONFIG_PATHS = ("data_dir", "init_from")
_EVALUATION_PATHS = ("transfer_from",)


def resolve_config_paths(config) -> None:
    """The config's path fields as `rspc_jax.resolve_path` makes them, so that a relative or
    `~` path in a config or an override names the same file in every tool and in the
    config.json that a run writes."""
    for key in _CONFIG_PATHS:
        if key in config:
            config[key] = resolve_path(config[key])
    evaluation = config.get("evaluation") or {}
    for key in list(evaluation.keys()):
        is_path = key.endswith("_dir") or key in _EVALUATION_PATHS
        if is_path and isinstance(evaluation[key], str):
            evaluation[key] = resolve_path(evaluation[key])


def _program() -> str:
    """'rspc_jax.main' under `python -m rspc_jax.main`, else the script's name."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec.name if spec else os.path.basename(sys.argv[0])


def _fail(message: str) -> None:
    """One paragraph on stderr, exit status 1."""
    text = f"{_program()}: error: {' '.join(str(message).split())}"
    print(textwrap.fill(text, width=100), file=sys.stderr, flush=True)
    sys.exit(1)


def _config_paths(argv: list[str]) -> list[str]:
    """The files of --config=PATH[:arg] / --config PATH[:arg] in `argv`."""
    paths = []
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            paths.append(arg.split("=", 1)[1])
        elif arg == "--config" and i + 1 < len(argv):
            paths.append(argv[i + 1])
    return [p.split(":", 1)[0] for p in paths]


def _flag_error_text(error: Exception) -> str:
    """ml_collections reports a --config.<field> that does not exist as an AttributeError
    whose text is the repr of "'field'\\nDid you mean ...?"; absl's errors are plain text."""
    text = str(error.args[0]) if error.args else str(error)
    if isinstance(error, AttributeError):
        try:
            text = "the config has no field " + ". ".join(str(ast.literal_eval(text)).split("\n"))
        except (ValueError, SyntaxError):
            pass
    return text if text.endswith((".", "?")) else text + "."


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's parsing, with errors (unknown flags, a missing config file, a config field that
    does not exist) as one paragraph instead of chained tracebacks."""
    for path in _config_paths(argv):
        if not os.path.isfile(path):
            _fail(
                f"config file {path!r} does not exist. Pass a config file, e.g. "
                "--config=configs/demo.py (the project's configs are in configs/).",
            )
    try:
        return flags.FLAGS(argv)
    except Exception as error:
        if "--verbose" in argv:
            raise
        _fail(f"{_flag_error_text(error)} Run with --helpfull to list the flags.")


class _OrbaxTasks(std_logging.Filter):
    """Drops asyncio's "Task/Future exception was never retrieved" records of orbax's
    writes (a task of orbax's code, or a future failed writing into orbax's temporary
    checkpoint folder): when one write of a save fails (a full disk), the writes gathered
    with it fail too and are logged, each with its traceback, when collected at exit, after
    the one paragraph that already reports the failure."""

    def filter(self, record) -> bool:
        message = record.getMessage()
        return _ORBAX not in message and _ORBAX_TEMPORARY not in message


def _hide_orbax_leftovers() -> None:
    """After a failed checkpoint read or write, orbax's abandoned coroutines fail again when
    collected ("Exception ignored in <coroutine ...>", each with a whole TensorStore spec),
    its abandoned tasks are logged by asyncio ("Task exception was never retrieved") and
    tensorstore completes the remaining futures into closed event loops ("Event loop is
    closed"): dozens of tracebacks around an error that is already reported once, in one
    paragraph. Only those are dropped (--verbose keeps them)."""
    std_logging.getLogger("asyncio").addFilter(_OrbaxTasks())
    excepthook, unraisablehook = sys.excepthook, sys.unraisablehook

    def quiet_excepthook(kind, value, tb):  # the same error printed from tensorstore's threads
        if not (kind is RuntimeError and str(value) == "Event loop is closed"):
            excepthook(kind, value, tb)

    def quiet_unraisablehook(unraisable):
        code = getattr(unraisable.object, "cr_code", None)  # a coroutine's code
        closed_loop = unraisable.exc_type is RuntimeError and (
            str(unraisable.exc_value) == "Event loop is closed"
        )
        if closed_loop or (code is not None and _ORBAX in code.co_filename):
            return
        unraisablehook(unraisable)

    sys.excepthook, sys.unraisablehook = quiet_excepthook, quiet_unraisablehook


def run(main: Callable[[list[str]], None]) -> None:
    """`app.run(main)` for the package's tools: a ReportedError (bad input, missing data,
    a diverged run) prints its message as one paragraph and exits with status 1; --verbose
    adds the traceback. Other exceptions are internal errors and keep theirs. First, with
    --malloc=tcmalloc, the tool restarts with tcmalloc if the system has it (tools.allocator)."""

    def reported(argv):
        if _MALLOC.value == "tcmalloc":
            allocator.reexecute_with_tcmalloc()
        skip_absent_tpu()
        if not _VERBOSE.value:
            _hide_orbax_leftovers()
        try:
            main(argv)
        except ReportedError as error:
            if _VERBOSE.value:
                traceback.print_exc()
            _fail(str(error))

    app.run(reported, flags_parser=_parse_flags)


# PCI vendor of Google's TPU chips (/sys/bus/pci/devices/*/vendor on a TPU VM).
_TPU_VENDOR = "0x1ae0"


def skip_absent_tpu() -> None:
    """Runs JAX on the CPU where libtpu is installed (the test requirements bring it, for
    the TPU compiler) but the host has no TPU chip and no other PJRT plugin (a GPU's
    `jax_plugins`): otherwise JAX starts libtpu first, which prints warnings about
    TPU_ACCELERATOR_TYPE and TPU_WORKER_HOSTNAMES into every tool's output and takes
    libtpu's one-per-machine lock. An explicit JAX_PLATFORMS is kept."""
    if "JAX_PLATFORMS" in os.environ or importlib.util.find_spec("libtpu") is None:
        return
    if importlib.util.find_spec("jax_plugins") is not None:
        return
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        with open(vendor) as f:
            if f.read().strip() == _TPU_VENDOR:
                return
    os.environ["JAX_PLATFORMS"] = "cpu"  # for this process's JAX and the tools it starts
    if "jax" in sys.modules:
        sys.modules["jax"].config.update("jax_platforms", "cpu")


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
        """Keyword arguments of evaluation.run_suites.run_suites and .run_analyses."""
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
        workdir=DEFINE_path(
            "workdir",
            None,
            f"Training run whose checkpoint to {verb}; results go to <workdir>/{out_dir}.",
        ),
        checkpoint=DEFINE_path(
            "checkpoint",
            None,
            f"{verb.capitalize()} this PyTorch/"
            "safetensors/npz checkpoint instead of the workdir's "
            "(rspc_jax.interop.state_dicts).",
        ),
        step=flags.DEFINE_integer("step", None, "Checkpoint step of the workdir; default: latest."),
        ema=flags.DEFINE_bool("ema", False, f"{verb.capitalize()} the EMA weights."),
        out=DEFINE_path("out", None, f"Output directory; default <workdir>/{out_dir}."),
    )


class _OursOrAtLeast(std_logging.Filter):
    """Passes this package's records, and other records from `level` up, except orbax's
    errors: a failed save logs dozens of tracebacks from its threads, and the
    CheckpointSaveError it becomes already names the cause (--verbose shows them)."""

    def __init__(self, level: str):
        super().__init__()
        self.level = std_logging.getLevelName(level.upper())

    def filter(self, record) -> bool:
        if _PACKAGE_DIR in record.pathname:
            return True
        if _ORBAX in record.pathname and not _VERBOSE.value:
            return record.levelno >= std_logging.CRITICAL
        return record.levelno >= self.level


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ORBAX = os.sep + os.path.join("orbax", "checkpoint") + os.sep
_ORBAX_TEMPORARY = ".orbax-checkpoint-tmp"  # the folder orbax writes a step into


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
    logging.info("Memory allocator: %s.", allocator.describe())
    if config is not None:
        resolve_config_paths(config)
        parallel.maybe_initialize_distributed(config.distributed)
    return config
