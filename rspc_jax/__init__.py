"""rspc_jax: RSPC (Guo, Stutz, Schiele, CVPR 2023) in JAX/Flax for TPU pods."""

__version__ = "0.1.0"


class ReportedError(Exception):
    """A failure whose message names the problem and the fix (a bad config value, a missing
    or unreadable file, a diverged run). The command-line tools print only the message and
    exit with status 1; any other exception is an internal error and keeps its traceback."""


class ConfigError(ReportedError, ValueError):
    """A config value, flag or path that cannot work; raised before anything compiles."""
