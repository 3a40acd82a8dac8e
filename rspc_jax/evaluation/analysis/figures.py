"""Figures of the analyses (matplotlib, PNG): the layer-similarity heat maps (Fig. 7), the
lesion plots (Fig. 8), restricted attention (Fig. 9) and the spatial-attack grid."""

import numpy as np

from rspc_jax.evaluation.figures import plt, save


def layer_correlation(result: dict, figures: dict, out_dir: str) -> list[str]:
    titles = dict(
        pearson_all="Pearson, all tokens",
        pearson_summary="Pearson, " + figures["summary_token"],
        cka_all="linear CKA, all tokens",
        cka_summary="linear CKA, " + figures["summary_token"],
    )
    fig, axes = plt.subplots(2, 2, figsize=(10, 9), layout="constrained")
    # Blocks of different sizes have no Pearson correlation: grey.
    cmap = plt.get_cmap("viridis").with_extremes(bad="lightgrey")
    for ax, (key, title) in zip(axes.flat, titles.items()):
        matrix = np.asarray(figures["matrices"][key], float)
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
    return [save(fig, out_dir, "layer_correlation.png")]


def lesion(result: dict, figures: dict, out_dir: str) -> list[str]:
    fig, (top, bottom) = plt.subplots(1, 2, figsize=(11, 4))
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
    return [save(fig, out_dir, "lesion.png")]


def restricted_attention(result: dict, figures: dict, out_dir: str) -> list[str]:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
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
    return [save(fig, out_dir, "restricted_attention.png")]


def spatial_attack(result: dict, figures: dict, out_dir: str) -> list[str]:
    points, per_point = figures["points"], figures["per_point"]
    shifts = np.asarray(result["translations"])
    grid = np.asarray(
        [
            [per_point[(points[:, 0] == dy) & (points[:, 1] == dx)].mean() for dx in shifts]
            for dy in shifts
        ]
    )
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    half = (shifts[1] - shifts[0]) / 2 if len(shifts) > 1 else 0.5  # cells centred on the values
    extent = (shifts[0] - half, shifts[-1] + half) * 2
    image = left.imshow(100 * grid, origin="lower", extent=extent)
    left.set_xlabel("dx (px)")
    left.set_ylabel("dy (px)")
    left.set_title("accuracy (%), mean over rotations")
    fig.colorbar(image, ax=left, fraction=0.046)
    right.plot(result["rotations"], 100 * np.asarray(result["accuracy_by_rotation"]), marker=".")
    right.axhline(
        100 * result["robust"], color="r", linestyle="--", label="robust (all grid points)"
    )
    right.set_xlabel("rotation (degrees)")
    right.set_ylabel("accuracy (%)")
    right.set_title("mean over translations")
    right.legend(fontsize=8)
    return [save(fig, out_dir, "spatial_attack.png")]


FIGURES = dict(
    layer_correlation=layer_correlation,
    lesion=lesion,
    restricted_attention=restricted_attention,
    spatial_attack=spatial_attack,
)
