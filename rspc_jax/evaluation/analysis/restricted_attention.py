"""restricted_attention (Bhojanapalli et al. Fig. 9): accuracy with attention restricted to
nearby patches, to as many random patch pairs, and without patch-to-patch attention in the
first or last k blocks."""

import functools

import numpy as np

from rspc_jax.evaluation import figures as plots
from rspc_jax.evaluation import report
from rspc_jax.evaluation.analysis import attention_masks, blocks
from rspc_jax.evaluation.loop import Context, SuiteSkipped
from rspc_jax.models import interventions, xcit

# The summary writes n/a where a number is missing.
_pct = functools.partial(report.pct, missing="n/a")


def run(ctx: Context) -> dict:
    if isinstance(ctx.model, xcit.XCiT):
        raise SuiteSkipped(
            "XCiT's self-attention (XCA) attends between channels, not patches, so "
            "restricting attention between patches does not apply"
        )
    prefix = interventions.num_prefix_tokens(ctx.model)
    tokens = [shape[-1] for shape in blocks.block_shapes(ctx)[1]]
    sides = [attention_masks.grid_side(n, prefix) for n in tokens]
    s = ctx.settings
    accuracy = blocks.intervention_accuracy(ctx, "restricted_attention")

    def masked(allowed_per_block) -> interventions.Intervention:
        return interventions.Intervention(
            attention_bias=tuple(attention_masks.bias(a) for a in allowed_per_block)
        )

    def unrestricted(side):
        return attention_masks.local(side, prefix, radius=2 * side)

    radii = list(s.radii) or list(range(max(sides)))
    result = dict(
        unrestricted=accuracy(masked([unrestricted(k) for k in sides]), "none"),
        radii=radii,
        local=[],
        random=[],
        masked_fraction=[],
    )
    patch_pairs = (sides[0] ** 2) ** 2
    for radius in radii:
        local = [attention_masks.local(side, prefix, radius) for side in sides]
        random = [attention_masks.random_like(a, prefix, s.random_mask_seed) for a in local]
        result["local"].append(accuracy(masked(local), f"radius {radius}"))
        result["random"].append(accuracy(masked(random), f"random, radius {radius}"))
        result["masked_fraction"].append(
            attention_masks.masked_pairs(local[0], prefix) / patch_pairs
        )
    num_blocks = len(sides)
    counts = list(s.cls_only_blocks) or list(range(1, num_blocks + 1))
    cut = [attention_masks.no_patch_to_patch(side, prefix) for side in sides]
    full = [unrestricted(side) for side in sides]
    result["no_patch_attention"] = dict(
        blocks=counts,
        first=[accuracy(masked(cut[:k] + full[k:]), f"first {k} blocks") for k in counts],
        last=[
            accuracy(masked(full[: num_blocks - k] + cut[num_blocks - k :]), f"last {k} blocks")
            for k in counts
        ],
    )
    result["definitions"] = dict(
        local=(
            "patches attend only to patches within Chebyshev distance <= radius on the "
            "block's patch grid; class tokens attend to and from every token"
        ),
        random=(
            "the same number of masked patch pairs at places given by a fixed random "
            f"permutation (seed {s.random_mask_seed}) of the off-diagonal patch pairs"
        ),
        no_patch_attention=(
            "no attention between patches in the first / last k blocks: "
            + (
                "patches attend to the class token only"
                if prefix
                else "the model has no class token, so each patch attends to itself only"
            )
        ),
        masked_fraction="masked patch pairs / all patch pairs of the first block's grid",
    )
    result["figures"] = {}
    return result


def rows(r: dict) -> list[str]:
    lines = [
        f"unrestricted: {_pct(r['unrestricted'])}%",
        "| radius | masked pairs | local | random |",
        "|---|---|---|---|",
    ]
    for radius, fraction, local, random in zip(
        r["radii"], r["masked_fraction"], r["local"], r["random"]
    ):
        lines.append(f"| {radius} | {100 * fraction:.1f}% | {_pct(local)} | {_pct(random)} |")
    cut = r["no_patch_attention"]
    lines += ["| k blocks without patch-patch attention | first k | last k |", "|---|---|---|"]
    lines += [
        f"| {k} | {_pct(a)} | {_pct(b)} |"
        for k, a, b in zip(cut["blocks"], cut["first"], cut["last"])
    ]
    return lines


def figures(result: dict, arrays: dict, out_dir: str) -> list[str]:
    fig, (left, right) = plots.plt.subplots(1, 2, figsize=(11, 4))
    left.plot(
        result["radii"], 100 * np.asarray(result["local"]), marker="o", label="local (distance ≤ r)"
    )
    left.plot(
        result["radii"],
        100 * np.asarray(result["random"]),
        marker="o",
        linestyle="--",
        label="random, same amount",
    )
    left.axhline(100 * result["unrestricted"], color="k", linestyle=":", label="unrestricted")
    left.set_xticks(result["radii"])
    left.set_xlabel("maximum patch distance r")
    left.set_ylabel("accuracy (%)")
    left.legend(fontsize=8)
    cut = result["no_patch_attention"]
    right.plot(cut["blocks"], 100 * np.asarray(cut["first"]), marker="o", label="first k blocks")
    right.plot(cut["blocks"], 100 * np.asarray(cut["last"]), marker="o", label="last k blocks")
    right.set_xticks(cut["blocks"])
    right.set_xlabel("k blocks without patch-to-patch attention")
    right.set_ylabel("accuracy (%)")
    right.legend(fontsize=8)
    return [plots.save(fig, out_dir, "restricted_attention.png")]
