"""layer_correlation (Bhojanapalli et al. Fig. 7): the Pearson correlation and linear CKA
between every pair of blocks' outputs, over all tokens and over the summary token."""

import numpy as np

from rspc_jax.evaluation import figures as plots
from rspc_jax.evaluation import loop as runner
from rspc_jax.evaluation.analysis import blocks, similarity
from rspc_jax.evaluation.loop import Context
from rspc_jax.models import interventions


def run(ctx: Context) -> dict:
    prefix = interventions.num_prefix_tokens(ctx.model)

    def step(variables, batch):
        outputs = blocks.intermediates(ctx, variables, batch["image"])["block_outputs"]
        mask = batch["mask"]
        all_tokens = [o.reshape(o.shape[0], -1) for o in outputs]
        summary = [o[:, 0] if prefix else o.mean(axis=1) for o in outputs]
        return dict(
            pearson_all=similarity.pearson_sums(all_tokens, mask),
            pearson_summary=similarity.pearson_sums(summary, mask),
            hsic_all=similarity.hsic_sums(all_tokens, mask),
            hsic_summary=similarity.hsic_sums(summary, mask),
            examples=mask.sum(),
        )

    sums = runner.sum_pass(ctx, runner.sharded_sum(ctx, step), label="layer_correlation")
    examples = float(sums["examples"])
    matrices = dict(
        pearson_all=sums["pearson_all"] / examples,
        pearson_summary=sums["pearson_summary"] / examples,
        cka_all=similarity.cka_from_hsic(sums["hsic_all"]),
        cka_summary=similarity.cka_from_hsic(sums["hsic_summary"]),
    )
    summary_token = "class token" if prefix else "mean of the tokens (the model has no class token)"
    return dict(
        definitions=dict(
            pearson=(
                "Pearson correlation of two blocks' flattened outputs, per example, averaged "
                "over examples (our reading of Bhojanapalli et al. Fig. 7; the paper does not "
                "define its statistic); null where the blocks' outputs differ in size"
            ),
            cka="linear CKA over examples, minibatch estimate with the unbiased HSIC (an extra)",
            all="all tokens of the block output",
            summary=summary_token,
        ),
        num_examples=int(examples),
        **{k: blocks.json_matrix(v) for k, v in matrices.items()},
        figures=dict(matrices=matrices, summary_token=summary_token),
    )


def rows(r: dict) -> list[str]:
    lines = [f"examples: {r['num_examples']}; rows/columns = blocks 0..{len(r['pearson_all']) - 1}"]
    for key in ("pearson_all", "pearson_summary", "cka_all", "cka_summary"):
        lines.append(f"{key}:")
        lines += [
            "  " + " ".join("  n/a" if v is None else f"{v:5.2f}" for v in row) for row in r[key]
        ]
    return lines


def figures(result: dict, arrays: dict, out_dir: str) -> list[str]:
    titles = dict(
        pearson_all="Pearson, all tokens",
        pearson_summary="Pearson, " + arrays["summary_token"],
        cka_all="linear CKA, all tokens",
        cka_summary="linear CKA, " + arrays["summary_token"],
    )
    fig, axes = plots.plt.subplots(2, 2, figsize=(10, 9), layout="constrained")
    # Blocks of different sizes have no Pearson correlation: grey.
    cmap = plots.plt.get_cmap("viridis").with_extremes(bad="lightgrey")
    for ax, (key, title) in zip(axes.flat, titles.items()):
        matrix = np.asarray(arrays["matrices"][key], float)
        image = ax.imshow(
            np.ma.masked_invalid(matrix),
            cmap=cmap,
            vmin=min(0.0, np.nanmin(matrix)),
            vmax=1.0,
            origin="lower",
        )
        ax.set_title(title, fontsize=9)
        ticks = np.arange(matrix.shape[0])
        ax.set_xticks(ticks)
        ax.set_yticks(ticks)
        ax.set_xlabel("block")
        ax.set_ylabel("block")
        fig.colorbar(image, ax=ax, fraction=0.046)
    return [plots.save(fig, out_dir, "layer_correlation.png")]
