"""The paper's figures from the suites' outputs (matplotlib, PNG, no display needed)."""

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


def occlusion_boxplot(result: dict, out_dir: str) -> str:
    """Fig. 2 right: accuracy over random masks (box), clean accuracy (star), and the
    trained corruption model's mask (diamond)."""
    fig, ax = plt.subplots(figsize=(3.2, 3.6))
    ax.boxplot([100 * np.asarray(result["per_mask_accuracy"])], widths=0.5)
    ax.plot(1, 100 * result["clean_accuracy"], "*", ms=14, color="gold", mec="k", label="clean")
    if "learned_mask_accuracy" in result:
        ax.plot(1, 100 * result["learned_mask_accuracy"], "D", color="tab:red", label="C's mask")
    ax.set_xticks([1], [f"{result['occluded_patches']}/{result['num_patches']} patches"])
    ax.set_ylabel("top-1 accuracy (%)")
    ax.set_title(f"random occlusion, {result['masks_per_image']} masks")
    ax.legend(fontsize=8)
    return save(fig, out_dir, "occlusion_boxplot.png")


def cos_sim_histogram(per_image: np.ndarray, out_dir: str) -> str:
    """Fig. 5: per-image attention Cos-Sim, clean vs one random occlusion."""
    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    ax.hist(per_image, bins=30, range=(min(0.0, float(per_image.min())), 1.0), color="tab:blue")
    ax.axvline(float(per_image.mean()), color="k", ls="--", label=f"mean {per_image.mean():.3f}")
    ax.set_xlabel("attention Cos-Sim (mean over layers and heads)")
    ax.set_ylabel("images")
    ax.legend(fontsize=8)
    return save(fig, out_dir, "cos_sim_histogram.png")


def attention_maps(maps: dict, out_dir: str) -> list[str]:
    """Figs. 2 left and 4: per image, the centre patch's head-mean attention in every
    layer, clean (top row) and occluded (bottom row)."""
    paths = []
    layers = len(maps["clean"])
    for i in range(len(maps["images"])):
        fig, axes = plt.subplots(2, layers + 1, figsize=(1.6 * (layers + 1), 3.4), squeeze=False)
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
        paths.append(save(fig, out_dir, f"attention_maps_{i}.png"))
    return paths


def learned_masks(masks: dict, out_dir: str) -> str:
    """Fig. 6: the patches the trained corruption model occludes, shaded on the images."""
    images, keep, grid = masks["images"], masks["keep"], masks["grid"]
    fig, axes = plt.subplots(1, len(images), figsize=(2 * len(images), 2.2), squeeze=False)
    for ax, image, k in zip(axes[0], images, keep):
        patch = image.shape[0] // grid
        shade = np.repeat(np.repeat(1 - k.reshape(grid, grid), patch, 0), patch, 1)
        overlay = image * (1 - 0.6 * shade[..., None]) + 0.6 * shade[..., None] * np.array(
            [1, 0, 0]
        )
        ax.imshow(np.clip(overlay, 0, 1))
        ax.axis("off")
    fig.suptitle("patches chosen by the corruption model (red)", fontsize=9)
    return save(fig, out_dir, "learned_masks.png")


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


def adversarial_bars(result: dict, out_dir: str) -> str:
    accuracy = result["accuracy"]
    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    ax.bar(list(accuracy), [100 * v for v in accuracy.values()], color="tab:green")
    ax.set_ylabel("top-1 accuracy (%)")
    ax.tick_params(axis="x", rotation=30)
    ax.set_title(f"attacks on {result['num_examples']} images", fontsize=9)
    return save(fig, out_dir, "adversarial.png")


def make(suite: str, result: dict, figures: dict, out_dir: str) -> list[str]:
    """All figures of one suite; returns their paths."""
    paths = []
    if suite == "patch_occlusion":
        paths.append(occlusion_boxplot(result, out_dir))
        if "learned_masks" in figures:
            paths.append(learned_masks(figures["learned_masks"], out_dir))
    elif suite == "attention_stability":
        paths.append(cos_sim_histogram(figures["histogram"], out_dir))
        if "query_maps" in figures:
            paths.extend(attention_maps(figures["query_maps"], out_dir))
    elif suite in ("corrupted_local", "imagenet_c", "cifar10_c", "cifar100_c"):
        paths.append(corruption_errors(result, out_dir, suite))
    elif suite == "adversarial":
        paths.append(adversarial_bars(result, out_dir))
    return paths
