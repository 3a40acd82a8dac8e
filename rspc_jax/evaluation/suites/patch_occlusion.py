"""patch_occlusion (paper Fig. 2 right): accuracy under random patch occlusion, under every
mask where there are few enough, and under the trained corruption model's own masks, with
the statistics of C's selection and its masks (Fig. 6)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from rspc_jax import rspc
from rspc_jax.evaluation import figures as plots
from rspc_jax.evaluation import loop as runner
from rspc_jax.evaluation import occlusion, report, selection
from rspc_jax.evaluation.loop import Context, run_pass, sharded
from rspc_jax.evaluation.suites import shared


def chosen_keep(rspc_config, patch_size: int, params, images, rho: float, seed: int):
    """The masks of the corruption model `params` (built as `rspc_config` says): by the
    official rule, or (a C that samples its masks) its deterministic choice, the lowest
    standardised scores, ties broken by fixed draws from `seed`."""
    scores = rspc.make_corruption_model(rspc_config, patch_size).apply({"params": params}, images)
    if rspc.selection_temperature(rspc_config) is None:
        return rspc.keep_mask(scores, rho)
    ties = jax.random.gumbel(jax.random.PRNGKey(seed), scores.shape)
    return rspc.sampled_keep_mask(scores, rho, ties, 0.0)


def learned_keep(ctx: Context, images):
    """The evaluated run's own C's masks (`chosen_keep`)."""
    return chosen_keep(
        ctx.config.rspc,
        ctx.patch_size,
        ctx.corruption_params,
        images,
        ctx.settings.occlusion_rho,
        ctx.seed,
    )


def noise_key(ctx: Context) -> jax.Array:
    """The pass key: its fold per batch is the noise of every shared mask and of C's masks,
    which adaptive_occlusion and transfer_occlusion reuse, so that their masks are compared
    with these under the same noise."""
    return jax.random.PRNGKey(ctx.seed + 1)


def correct_under(ctx: Context, variables, batch, keep, rng):
    """Correct (B,) with the images occluded by `keep` (B, N), fresh noise from `rng`."""
    logits = ctx.logits(variables, ctx.occlude(batch["image"], keep, rng))
    return runner.correct(logits, batch["label"])


def _learned_outputs(ctx: Context, variables, batch, rng) -> dict:
    """Correct under C's masks, the occluded patches and (where the dataset says where its
    object is) which patches lie on the object."""
    images = batch["image"]
    keep = learned_keep(ctx, images)
    out = dict(
        learned=correct_under(ctx, variables, batch, keep, rng),
        learned_occluded=(keep == 0).astype(jnp.int8),
    )
    if ctx.spec.object_threshold is not None:
        pixels = images * jnp.asarray(ctx.spec.std) + jnp.asarray(ctx.spec.mean)
        out["on_object"] = rspc.object_patches(
            pixels, ctx.patch_size, ctx.spec.object_threshold
        ).astype(jnp.int8)
    return out


def _step(ctx: Context, every, learned: bool):
    """The per-device step: correct when clean, under `masks_per_image` random masks, under
    each of `every` (the same mask for every image, the same noise for every mask) and
    under C's masks."""
    occluded = ctx.occluded_count()

    def step(variables, batch, rng):
        size = batch["image"].shape[0]

        def one_random_mask(key):
            mask_key, noise = jax.random.split(key)
            keep = occlusion.random_keep_masks(mask_key, size, ctx.num_patches(), occluded)
            return correct_under(ctx, variables, batch, keep, noise)

        def one_shared_mask(keep):
            keep = jnp.broadcast_to(keep, (size, keep.shape[0]))
            return correct_under(ctx, variables, batch, keep, rng)

        keys = jax.random.split(rng, ctx.settings.occlusion_masks)
        out = dict(
            clean=runner.correct(ctx.logits(variables, batch["image"]), batch["label"]),
            random=jax.lax.map(one_random_mask, keys).T,
        )
        if every is not None:
            out["every"] = jax.lax.map(one_shared_mask, every).T
        if learned:
            out.update(_learned_outputs(ctx, variables, batch, rng))
        return out

    return step


def run(ctx: Context) -> dict:
    occluded = ctx.occluded_count()
    learned = ctx.corruption_params is not None and ctx.settings.occlusion_rho > 0
    every = None
    if 0 < math.comb(ctx.num_patches(), occluded) <= ctx.settings.occlusion_every_mask_limit:
        every = jnp.asarray(occlusion.every_keep_mask(ctx.num_patches(), occluded))
    out = run_pass(
        ctx,
        sharded(ctx, _step(ctx, every, learned)),
        noise_key(ctx),
        label="patch_occlusion",
    )
    per_mask = out["random"].mean(axis=0)
    result = dict(
        rho=ctx.settings.occlusion_rho,
        occluded_patches=occluded,
        num_patches=ctx.num_patches(),
        masks_per_image=ctx.settings.occlusion_masks,
        clean_accuracy=float(out["clean"].mean()),
        random_mask_accuracy=shared.distribution(per_mask),
        per_mask_accuracy=[float(a) for a in per_mask],
        num_examples=int(out["clean"].size),
    )
    if every is not None:
        result["every_mask_accuracy"] = dict(
            masks=int(every.shape[0]),
            mean=float(out["every"].mean()),
            worst_case=float(out["every"].min(axis=1).mean()),
        )
    if learned:
        result["learned_mask_accuracy"] = float(out["learned"].mean())
        result["selection"] = _selection_statistics(out["learned_occluded"], out.get("on_object"))
        if ctx.spec.background is not None:
            result["selection"]["blank_mask_iou"] = _blank_mask_iou(ctx, out["learned_occluded"])
        result["figures"] = dict(learned_masks=_learned_mask_examples(ctx))
    return result


def _selection_statistics(occluded: np.ndarray, on_object=None, pairs_of: int = 1024) -> dict:
    """evaluation/selection.py's numbers over the eval set: distinct masks counted exactly,
    the mask IoU over the first `pairs_of` images (it compares every pair)."""
    _, counts = np.unique(occluded, axis=0, return_counts=True)
    stats = dict(
        distinct_masks=int(len(counts)),
        modal_mask_share=float(counts.max()) / len(occluded),
        entropy=float(selection.selection_entropy(jnp.asarray(occluded))),
        mask_iou=float(selection.mask_iou(jnp.asarray(occluded[:pairs_of]))),
        mask_iou_images=int(min(len(occluded), pairs_of)),
        position_frequency=[float(f) for f in occluded.mean(axis=0)],
    )
    if on_object is not None:
        stats["on_object"] = float((occluded * on_object).sum() / max(occluded.sum(), 1))
    return stats


def _blank_mask_iou(ctx: Context, occluded: np.ndarray) -> float:
    """Mean IoU of each image's mask with C's mask of an image of pure background: 1 when C's
    choice comes from the background alone (the same for every image), not from the object."""
    size = ctx.config.image_size
    background = (ctx.spec.background - np.asarray(ctx.spec.mean)) / np.asarray(ctx.spec.std)
    blank = jnp.broadcast_to(jnp.asarray(background, jnp.float32), (1, size, size, 3))
    blank_occluded = np.asarray(learned_keep(ctx, blank)[0] == 0)
    intersection = (occluded.astype(bool) & blank_occluded).sum(axis=1)
    union = (occluded.astype(bool) | blank_occluded).sum(axis=1)
    return float(np.mean(intersection / np.maximum(union, 1)))


def _learned_mask_examples(ctx: Context) -> dict:
    images, _ = shared.first_batch(ctx, ctx.settings.figure_images)
    keep = jax.jit(functools.partial(learned_keep, ctx))(images)
    return dict(
        images=shared.to_pixels(ctx, images),
        keep=np.asarray(keep),
        grid=ctx.config.image_size // ctx.patch_size,
    )


def _selection_rows(result: dict) -> list[tuple[str, str]]:
    """The trained corruption model's rows: its masks' accuracy and selection statistics."""
    chosen = result["selection"]
    rows = [
        ("trained corruption model's mask (%)", report.pct(result["learned_mask_accuracy"])),
        ("C: distinct masks", f"{chosen['distinct_masks']} of {result['num_examples']}"),
        ("C: selection entropy (1 = uniform, 0 = one mask)", f"{chosen['entropy']:.3f}"),
        ("C: mean mask IoU of two images", f"{chosen['mask_iou']:.3f}"),
    ]
    if "on_object" in chosen:
        rows.append(("C: selected patches on the object (%)", report.pct(chosen["on_object"])))
    if "blank_mask_iou" in chosen:
        rows.append(
            ("C: mask IoU with its mask of a blank image", f"{chosen['blank_mask_iou']:.3f}")
        )
    return rows


def rows(result: dict) -> list[tuple[str, str]]:
    dist, pct = result["random_mask_accuracy"], report.pct
    lines = [
        ("clean (%)", pct(result["clean_accuracy"])),
        ("random masks: mean ± std (%)", f"{pct(dist['mean'])} ± {100 * dist['std']:.2f}"),
        (
            "random masks: min / median / max (%)",
            f"{pct(dist['min'])} / {pct(dist['median'])} / {pct(dist['max'])}",
        ),
    ]
    if "learned_mask_accuracy" in result:
        lines += _selection_rows(result)
    return lines + [
        ("occluded patches", f"{result['occluded_patches']} of {result['num_patches']}"),
        ("masks per image", str(result["masks_per_image"])),
    ]


def _boxplot(result: dict, out_dir: str) -> str:
    """Fig. 2 right: accuracy over random masks (box), clean accuracy (star), and the
    trained corruption model's mask (diamond)."""
    fig, ax = plots.plt.subplots(figsize=(3.2, 3.6))
    ax.boxplot([100 * np.asarray(result["per_mask_accuracy"])], widths=0.5)
    ax.plot(1, 100 * result["clean_accuracy"], "*", ms=14, color="gold", mec="k", label="clean")
    if "learned_mask_accuracy" in result:
        ax.plot(1, 100 * result["learned_mask_accuracy"], "D", color="tab:red", label="C's mask")
    ax.set_xticks([1], [f"{result['occluded_patches']}/{result['num_patches']} patches"])
    ax.set_ylabel("top-1 accuracy (%)")
    ax.set_title(f"random occlusion, {result['masks_per_image']} masks")
    ax.legend(fontsize=8)
    return plots.save(fig, out_dir, "occlusion_boxplot.png")


def _learned_masks(masks: dict, out_dir: str) -> str:
    """Fig. 6: the patches the trained corruption model occludes, shaded on the images."""
    images, keep, grid = masks["images"], masks["keep"], masks["grid"]
    patch = images.shape[1] // grid
    shade = 1 - np.asarray(rspc.patch_mask_to_pixels(jnp.asarray(keep), (grid, grid), patch))
    fig, axes = plots.plt.subplots(1, len(images), figsize=(2 * len(images), 2.2), squeeze=False)
    for ax, image, occluded in zip(axes[0], images, shade):
        overlay = image * (1 - 0.6 * occluded) + 0.6 * occluded * np.array([1, 0, 0])
        ax.imshow(np.clip(overlay, 0, 1))
        ax.axis("off")
    fig.suptitle("patches chosen by the corruption model (red)", fontsize=9)
    return plots.save(fig, out_dir, "learned_masks.png")


def figures(result: dict, arrays: dict, out_dir: str) -> list[str]:
    paths = [_boxplot(result, out_dir)]
    if "learned_masks" in arrays:
        paths.append(_learned_masks(arrays["learned_masks"], out_dir))
    return paths
