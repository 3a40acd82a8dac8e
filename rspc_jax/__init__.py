"""rspc_jax: RSPC (Guo, Stutz, Schiele, CVPR 2023) in JAX/Flax for TPU pods."""

import os

__version__ = "0.1.0"


def resolve_path(path: str | None) -> str | None:
    """A path as a user types it (relative, `~`, absolute, `gs://...`) as every tool uses it:
    `~` expanded and a local path made absolute against the current directory (orbax refuses
    relative checkpoint paths), a URL unchanged. The one place paths are resolved: the
    tools' path flags (`tools.cli.DEFINE_path`), the config's path fields, the workdir of
    training and the checkpoint reader all call it; None and '' stay as they are."""
    if not path or "://" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


class ReportedError(Exception):
    """A failure whose message names the problem and the fix (a bad config value, a missing
    or unreadable file, a diverged run). The command-line tools print only the message and
    exit with status 1; any other exception is an internal error and keeps its traceback."""


class ConfigError(ReportedError, ValueError):
    """A config value, flag or path that cannot work; raised before anything compiles."""
