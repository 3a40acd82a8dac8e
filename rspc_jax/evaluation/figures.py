"""What the figures share (matplotlib without a display, PNG files) and the corruption
suites' common figure; each suite and analysis draws its own figure in its module."""

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def save(fig, out_dir: str, name: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def corruption_errors(result: dict, out_dir: str, suite: str) -> str:
    """Per-corruption top-1 error: mean over severities (bar) and severity 1..5 range."""
    names = result["corruptions"]
    severities = result["severities"]
    errors = np.array(
        [[100 * (1 - result["accuracy"][f"{n}/{s}"]) for s in severities] for n in names]
    )
    mean = errors.mean(axis=1)
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(names)), 3.4))
    x = np.arange(len(names))
    ax.bar(
        x,
        mean,
        color="tab:orange",
        yerr=[mean - errors.min(axis=1), errors.max(axis=1) - mean],
        capsize=3,
    )
    ax.set_xticks(x, names, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("top-1 error (%)")
    ax.set_title("corruption error (bar: mean over severities, whiskers: min-max)", fontsize=9)
    return save(fig, out_dir, f"{suite}_errors.png")
