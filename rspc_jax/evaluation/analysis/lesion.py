"""lesion (Bhojanapalli et al. Fig. 8): accuracy with one block, attention or MLP branch
removed, and with n random blocks removed."""

import functools

import numpy as np

from rspc_jax.evaluation import figures as plots
from rspc_jax.evaluation import report
from rspc_jax.evaluation.analysis import blocks
from rspc_jax.evaluation.loop import Context
from rspc_jax.models import interventions

# The summary writes n/a where a number is missing.
_pct = functools.partial(report.pct, missing="n/a")


def run(ctx: Context) -> dict:
    num_blocks = len(blocks.block_shapes(ctx)[0])
    branches = interventions.branch_names(ctx.model)
    accuracy = blocks.intervention_accuracy(ctx, "lesion")

    def removed(blocks, branch_names=interventions.BRANCHES) -> interventions.Intervention:
        keep = interventions.keep_all(num_blocks)
        for branch in branch_names:
            keep[np.asarray(blocks, int), interventions.BRANCHES.index(branch)] = 0.0
        return interventions.Intervention(keep=keep)

    intact = accuracy(removed([]), "none")
    single = {
        what: [
            accuracy(removed([i], branches if what == "block" else (what,)), f"{what} {i}")
            for i in range(num_blocks)
        ]
        for what in ("block",) + branches
    }
    rng = np.random.default_rng(ctx.seed)
    samples = ctx.settings.lesion_samples
    multiple = {}
    for n in range(2, num_blocks):  # the first block always stays
        accuracies = np.asarray(
            [
                accuracy(
                    removed(rng.choice(np.arange(1, num_blocks), n, replace=False)),
                    f"{n} random blocks",
                )
                for _ in range(samples)
            ]
        )
        multiple[str(n)] = dict(
            mean=float(accuracies.mean()),
            standard_error=float(accuracies.std(ddof=1) / np.sqrt(samples)) if samples > 1 else 0.0,
            min=float(accuracies.min()),
            max=float(accuracies.max()),
            samples=[float(a) for a in accuracies],
        )
    return dict(
        definitions=(
            "a removed block, attention or MLP has its residual branch set to zero at "
            "inference (x + f(x) -> x); n random blocks: drawn from all but the first "
            f"block, {samples} independent samples per n"
        ),
        num_blocks=num_blocks,
        intact=intact,
        single=single,
        random_blocks=multiple,
        figures={},
    )


def rows(r: dict) -> list[str]:
    kinds = list(r["single"])
    lines = [
        f"intact: {_pct(r['intact'])}%",
        "| block | " + " | ".join(f"remove {k}" for k in kinds) + " |",
        "|---|" + "---|" * len(kinds),
    ]
    for i in range(r["num_blocks"]):
        lines.append(f"| {i} | " + " | ".join(_pct(r["single"][k][i]) for k in kinds) + " |")
    if r["random_blocks"]:
        lines += ["| n random blocks | mean | s.e. | min | max |", "|---|---|---|---|---|"]
        for n, s in sorted(r["random_blocks"].items(), key=lambda item: int(item[0])):
            lines.append(
                f"| {n} | {_pct(s['mean'])} | {_pct(s['standard_error'])} | "
                f"{_pct(s['min'])} | {_pct(s['max'])} |"
            )
    return lines


def figures(result: dict, arrays: dict, out_dir: str) -> list[str]:
    fig, (top, bottom) = plots.plt.subplots(1, 2, figsize=(11, 4))
    kinds = list(result["single"])
    blocks = np.arange(result["num_blocks"])
    width = 0.8 / len(kinds)
    for k, kind in enumerate(kinds):
        top.bar(
            blocks + k * width,
            100 * np.asarray(result["single"][kind]),
            width,
            label=f"remove {kind}",
        )
    top.axhline(100 * result["intact"], color="k", linestyle="--", label="intact")
    top.set_xticks(blocks + width * (len(kinds) - 1) / 2, [str(b) for b in blocks])
    top.set_xlabel("removed block")
    top.set_ylabel("accuracy (%)")
    top.legend(fontsize=8)
    top.set_title("one block / sub-layer removed")
    if result["random_blocks"]:
        ns = sorted(result["random_blocks"], key=int)
        stats = [result["random_blocks"][n] for n in ns]
        x = np.asarray([int(n) for n in ns])
        mean = 100 * np.asarray([s["mean"] for s in stats])
        bottom.errorbar(
            x,
            mean,
            yerr=100 * np.asarray([s["standard_error"] for s in stats]),
            marker="o",
            capsize=3,
        )
        bottom.fill_between(
            x, [100 * s["min"] for s in stats], [100 * s["max"] for s in stats], alpha=0.2
        )
        bottom.set_xticks(x)
    bottom.set_xlabel("random blocks removed (first kept)")
    bottom.set_ylabel("accuracy (%)")
    bottom.set_title("mean ± s.e., min–max over samples")
    return [plots.save(fig, out_dir, "lesion.png")]
