"""The suites and analyses by name, each one plug-in module, imported only when asked for.

A plug-in module holds one evaluation whole (as big_vision's evaluators do):
  run(ctx) -> dict       the JSON-serialisable result; arrays for the figure under 'figures';
  rows(result) -> list   the report's lines: a suite's (metric, value) rows of report.md,
                         an analysis's lines of summary.md;
  figures(result, arrays, out_dir) -> list[str]   the PNG paths (only where it has figures);
  notes(result) -> list[str]   extra report lines after the settings (optional).
Adding one is a module and a line here.
"""

import difflib
import importlib
from types import ModuleType

from rspc_jax import ConfigError

_SUITE_MODULES = "rspc_jax.evaluation.suites"
_ANALYSIS_MODULES = "rspc_jax.evaluation.analysis"

SUITES = (
    "clean",
    "corrupted_local",
    "patch_occlusion",
    "adaptive_occlusion",
    "transfer_occlusion",
    "attention_stability",
    "adversarial",
    "imagenet_c",
    "imagenet_a",
    "imagenet_r",
    "imagenet_p",
    "cifar10_c",
    "cifar100_c",
)
ANALYSES = ("layer_correlation", "lesion", "restricted_attention", "spatial_attack")

_KINDS = {"suite": (SUITES, _SUITE_MODULES), "analysis": (ANALYSES, _ANALYSIS_MODULES)}


def names(kind: str, requested: str) -> list[str]:
    """The comma-separated `requested` names of `kind` ('suite' | 'analysis'), each checked:
    an unknown or empty list fails with the close matches and every registered name."""
    registered, _ = _KINDS[kind]
    chosen = [name for name in requested.split(",") if name]
    if not chosen:
        raise ConfigError(f"no {kind} named; choose from {', '.join(registered)} (comma-separated)")
    for name in chosen:
        if name not in registered:
            close = difflib.get_close_matches(name, registered, n=3)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(
                f"unknown {kind} {name!r}.{hint} Registered: {', '.join(registered)}."
            )
    return chosen


def plugin(kind: str, name: str) -> ModuleType:
    """The plug-in module of registered `name`."""
    registered, package = _KINDS[kind]
    (checked,) = names(kind, name)
    return importlib.import_module(f"{package}.{checked}")
