"""attention_stability (paper Figs. 2 left, 4, 5): per image, the cosine similarity of the
attention maps of the clean and of a randomly occluded image."""

import jax
import numpy as np

from rspc_jax.evaluation import figures as plots
from rspc_jax.evaluation import occlusion
from rspc_jax.evaluation.loop import Context, run_pass, sharded
from rspc_jax.evaluation.suites import shared

_MAPS = {
    "channels": "XCiT channel attention (d x d per head)",
    "windows": "Swin window attention (one w^2 x w^2 map per window and head)",
    "tokens": "token attention (N x N per head)",
}


def _occluded_maps(ctx: Context, variables, images, rng):
    """(occluded images, clean maps, occluded maps) under one random mask per image."""
    mask_key, noise_key = jax.random.split(rng)
    keep = occlusion.random_keep_masks(
        mask_key, images.shape[0], ctx.num_patches(), ctx.occluded_count()
    )
    corrupted = ctx.occlude(images, keep, noise_key)
    _, clean_maps = ctx.logits_and_attention(variables, images)
    _, occluded_maps = ctx.logits_and_attention(variables, corrupted)
    return corrupted, clean_maps, occluded_maps


def run(ctx: Context) -> dict:
    def step(variables, batch, rng):
        _, clean_maps, occluded_maps = _occluded_maps(ctx, variables, batch["image"], rng)
        return dict(cos=occlusion.attention_cosine(clean_maps, occluded_maps))

    out = run_pass(
        ctx, sharded(ctx, step), jax.random.PRNGKey(ctx.seed + 2), label="attention_stability"
    )
    per_image = out["cos"].mean(axis=1)
    kind = shared.attention_kind(ctx.model)
    result = dict(
        maps=_MAPS[kind],
        definition=(
            "per image: mean over layers and heads of cos(vec(A_clean), vec(A_occluded)), "
            "one random mask per image"
        ),
        occluded_patches=ctx.occluded_count(),
        mean_cos_sim=float(per_image.mean()),
        per_image=shared.distribution(per_image),
        per_image_values=[round(float(v), 5) for v in per_image],
        per_layer=[float(v) for v in out["cos"].mean(axis=0)],
        num_examples=int(per_image.size),
        figures=dict(histogram=per_image),
    )
    if kind == "tokens":  # a query patch's map over the whole grid
        result["figures"]["query_maps"] = _query_maps(ctx)
    return result


def _query_maps(ctx: Context) -> dict:
    """Head-mean attention of the centre patch per layer, clean vs one occlusion, for the
    first figure images (Figs. 2 left, 4)."""
    images, _ = shared.first_batch(ctx, ctx.settings.figure_images)

    @jax.jit
    def maps(variables, images, rng):
        corrupted, clean_maps, occluded_maps = _occluded_maps(ctx, variables, images, rng)
        return (
            corrupted,
            [occlusion.query_attention(m) for m in clean_maps],
            [occlusion.query_attention(m) for m in occluded_maps],
        )

    corrupted, clean_maps, occluded_maps = maps(
        ctx.variables, images, jax.random.PRNGKey(ctx.seed + 3)
    )
    return dict(
        images=shared.to_pixels(ctx, images),
        occluded=shared.to_pixels(ctx, corrupted),
        clean=[np.asarray(m) for m in clean_maps],
        occluded_maps=[np.asarray(m) for m in occluded_maps],
    )


def rows(result: dict) -> list[tuple[str, str]]:
    dist = result["per_image"]
    return [
        ("mean Cos-Sim", f"{result['mean_cos_sim']:.4f}"),
        (
            "per image min / median / max",
            f"{dist['min']:.4f} / {dist['median']:.4f} / {dist['max']:.4f}",
        ),
        ("per layer", ", ".join(f"{v:.3f}" for v in result["per_layer"])),
        ("maps", result["maps"]),
    ]


def _histogram(per_image: np.ndarray, out_dir: str) -> str:
    """Fig. 5: per-image attention Cos-Sim, clean vs one random occlusion."""
    fig, ax = plots.plt.subplots(figsize=(4.5, 3.2))
    ax.hist(per_image, bins=30, range=(min(0.0, float(per_image.min())), 1.0), color="tab:blue")
    ax.axvline(float(per_image.mean()), color="k", ls="--", label=f"mean {per_image.mean():.3f}")
    ax.set_xlabel("attention Cos-Sim (mean over layers and heads)")
    ax.set_ylabel("images")
    ax.legend(fontsize=8)
    return plots.save(fig, out_dir, "cos_sim_histogram.png")


def _attention_maps(maps: dict, out_dir: str) -> list[str]:
    """Figs. 2 left and 4: per image, the centre patch's head-mean attention in every
    layer, clean (top row) and occluded (bottom row)."""
    paths = []
    layers = len(maps["clean"])
    for i in range(len(maps["images"])):
        fig, axes = plots.plt.subplots(
            2, layers + 1, figsize=(1.6 * (layers + 1), 3.4), squeeze=False
        )
        for row, (image, per_layer) in enumerate(
            ((maps["images"][i], maps["clean"]), (maps["occluded"][i], maps["occluded_maps"]))
        ):
            axes[row, 0].imshow(image)
            axes[row, 0].set_title("clean" if row == 0 else "occluded", fontsize=8)
            for layer in range(layers):
                axes[row, layer + 1].imshow(per_layer[layer][i], cmap="viridis")
                if row == 0:
                    axes[row, layer + 1].set_title(f"layer {layer}", fontsize=8)
        for ax in axes.flat:
            ax.axis("off")
        paths.append(plots.save(fig, out_dir, f"attention_maps_{i}.png"))
    return paths


def figures(result: dict, arrays: dict, out_dir: str) -> list[str]:
    paths = [_histogram(arrays["histogram"], out_dir)]
    if "query_maps" in arrays:
        paths.extend(_attention_maps(arrays["query_maps"], out_dir))
    return paths
