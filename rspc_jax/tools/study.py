"""The small-scale reproduction study behind `python -m rspc_jax.study`.

Trains every method of config.study.methods ('rspc' or a name of rspc_jax.training.ablations) for
every seed of config.study.seeds with the config's budget, evaluates each run with the
config's suites, and writes DIR/results.md (mean ± std over seeds of every number, the
command, the hardware, wall-clock per run) and DIR/figures/. Runs live in
DIR/runs/<method>_s<seed>; a finished run is not trained or evaluated again, so an
interrupted study resumes where it stopped.
"""

import json
import os
import platform
import shutil
import time

from absl import logging
import jax
import numpy as np

# imagecorruptions' families (Hendrycks & Dietterich), for the per-family table.
FAMILIES = {
    "noise": ("gaussian_noise", "shot_noise", "impulse_noise"),
    "blur": ("defocus_blur", "glass_blur", "motion_blur", "zoom_blur"),
    "weather": ("snow", "frost", "fog", "brightness"),
    "digital": ("contrast", "elastic_transform", "pixelate", "jpeg_compression"),
}
LABELS = {
    "clean": "plain (no RSPC)",
    "rspc": "RSPC",
    "random_patches": "RSPC, random patches",
    "clean_and_corrupted": "clean + corrupted, no alignment",
}


def method_config(config, method: str, seed: int):
    """The base config switched to `method` with `seed`."""
    from rspc_jax.training import ablations

    config = config.copy_and_resolve_references()
    config.seed = seed
    if method == "rspc":
        config.rspc.enabled = True
    else:
        ablations.apply(config, method)
    return config


def run_one(config, workdir: str) -> dict:
    """Trains (unless finished) and evaluates (unless done) one run; its record."""
    from rspc_jax.evaluation import run_suites as evaluation_run
    from rspc_jax.training import loop as train

    record_path = os.path.join(workdir, "study_run.json")
    if os.path.exists(record_path):
        with open(record_path) as f:
            return json.load(f)
    start = time.time()
    train.train_and_evaluate(config, workdir)
    trained = time.time()
    results = evaluation_run.run_suites(config, workdir=workdir, out=os.path.join(workdir, "eval"))
    record = dict(
        train_seconds=round(trained - start, 1),
        eval_seconds=round(time.time() - trained, 1),
        results=results,
    )
    if jax.process_index() == 0:
        with open(record_path, "w") as f:
            json.dump(record, f)
    return record


def summarise(results: dict) -> dict:
    """The study's numbers of one run (fractions)."""
    row = {}
    if "clean" in results:
        row["clean accuracy"] = results["clean"]["top1"]
    occlusion = results.get("patch_occlusion", {})
    if "random_mask_accuracy" in occlusion:
        masks = occlusion["random_mask_accuracy"]
        row["occluded accuracy, mean over masks"] = masks["mean"]
        row["occluded accuracy, std over masks"] = masks["std"]
        row["occluded accuracy, worst mask"] = masks["min"]
    stability = results.get("attention_stability", {})
    if "mean_cos_sim" in stability:
        row["attention Cos-Sim, mean"] = stability["mean_cos_sim"]
        for layer, value in enumerate(stability["per_layer"]):
            row[f"attention Cos-Sim, block {layer}"] = value
    corrupted = results.get("corrupted_local", {})
    if "per_corruption" in corrupted:
        per = corrupted["per_corruption"]
        for family, names in FAMILIES.items():
            present = [per[n] for n in names if n in per]
            if present:
                row[f"corrupted accuracy, {family}"] = float(np.mean(present))
        row["corrupted accuracy, mean"] = corrupted["mean_accuracy"]
    adversarial = results.get("adversarial", {})
    if "pgd" in adversarial.get("accuracy", {}):
        row["PGD accuracy"] = adversarial["accuracy"]["pgd"]
    return row


def _mean_std(values) -> str:
    values = 100 * np.asarray(values, float)
    return (
        f"{values.mean():.2f} ± {values.std(ddof=1):.2f}" if len(values) > 1 else f"{values[0]:.2f}"
    )


def figures(records: dict, workdir: str, methods, seeds) -> list[str]:
    """Box plots of occlusion accuracy and Cos-Sim histograms per method (pooled over
    seeds); the first seed's attention maps (plain, RSPC) and learned masks, copied."""
    from rspc_jax.evaluation.figures import plt, save

    out = os.path.join(workdir, "figures")
    paths = []
    occlusion = {
        m: [
            a
            for s in seeds
            for a in records[m][s]["results"]
            .get("patch_occlusion", {})
            .get("per_mask_accuracy", [])
        ]
        for m in methods
    }
    if any(occlusion.values()):
        fig, ax = plt.subplots(figsize=(1.8 * len(methods) + 2, 4))
        ax.boxplot([100 * np.asarray(occlusion[m]) for m in methods])
        ax.set_xticks(range(1, len(methods) + 1), [LABELS.get(m, m) for m in methods], fontsize=8)
        clean = [
            100 * np.mean([records[m][s]["results"]["clean"]["top1"] for s in seeds])
            for m in methods
        ]
        ax.scatter(
            range(1, len(methods) + 1),
            clean,
            marker="*",
            s=120,
            color="tab:red",
            label="clean (mean over seeds)",
            zorder=3,
        )
        ax.set_ylabel("accuracy (%) per random mask")
        ax.set_title("random patch occlusion, masks of all seeds", fontsize=9)
        ax.legend(fontsize=8)
        paths.append(save(fig, out, "occlusion_boxplots.png"))
    cos = {
        m: [
            v
            for s in seeds
            for v in records[m][s]["results"]
            .get("attention_stability", {})
            .get("per_image_values", [])
        ]
        for m in methods
    }
    if any(cos.values()):
        fig, ax = plt.subplots(figsize=(6, 4))
        bins = np.linspace(min(min(v) for v in cos.values() if v), 1.0, 30)
        for m in methods:
            ax.hist(cos[m], bins=bins, histtype="step", linewidth=1.5, label=LABELS.get(m, m))
        ax.set_xlabel("per-image attention Cos-Sim, clean vs occluded")
        ax.set_ylabel("images (all seeds)")
        ax.legend(fontsize=8)
        paths.append(save(fig, out, "cos_sim_histograms.png"))
    first = seeds[0]
    for method, name in (
        ("clean", "attention_maps_0.png"),
        ("rspc", "attention_maps_0.png"),
        ("rspc", "learned_masks.png"),
    ):
        source = os.path.join(workdir, "runs", f"{method}_s{first}", "eval", "figures", name)
        if method in methods and os.path.exists(source):
            target = os.path.join(out, f"{method}_{name}")
            shutil.copyfile(source, target)
            paths.append(target)
    return paths


def write_results(records: dict, workdir: str, methods, seeds, figure_paths, command: str) -> str:
    rows = {m: [summarise(records[m][s]["results"]) for s in seeds] for m in methods}
    metrics = list(dict.fromkeys(k for m in methods for r in rows[m] for k in r))
    seconds = sum(
        records[m][s]["train_seconds"] + records[m][s]["eval_seconds"]
        for m in methods
        for s in seeds
    )
    lines = [
        "# Small-scale study: RSPC's effects on the embedded digits",
        "",
        f"Command: `{command}`",
        "",
        f"Hardware: {platform.machine()} CPU, {os.cpu_count()} cores; "
        f"JAX {jax.__version__} on {jax.device_count()} x {jax.devices()[0].device_kind}; "
        f"Python {platform.python_version()}. Wall-clock of all runs: {seconds / 60:.1f} min.",
        "",
        f"Seeds {list(seeds)}; every number is mean ± std over the seeds (percent).",
        "",
        "| metric | " + " | ".join(LABELS.get(m, m) for m in methods) + " |",
        "|---|" + "---:|" * len(methods),
    ]
    for metric in metrics:
        cells = []
        for m in methods:
            values = [r[metric] for r in rows[m] if metric in r]
            cells.append(_mean_std(values) if values else "—")
        lines.append(f"| {metric} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Wall-clock per run (train + evaluate):",
        "",
        "| run | train s | evaluate s |",
        "|---|---:|---:|",
    ]
    lines += [
        f"| {m} seed {s} | {records[m][s]['train_seconds']} | {records[m][s]['eval_seconds']} |"
        for m in methods
        for s in seeds
    ]
    if {"clean", "rspc"} <= set(methods):
        lines += [
            "",
            "RSPC against the plain baseline (differences of the seed means, points):",
            "",
        ]
        for metric in (
            "occluded accuracy, mean over masks",
            "attention Cos-Sim, mean",
            "clean accuracy",
        ):
            plain = [r[metric] for r in rows["clean"] if metric in r]
            ours = [r[metric] for r in rows["rspc"] if metric in r]
            if plain and ours:
                lines.append(f"- {metric}: {100 * (np.mean(ours) - np.mean(plain)):+.2f}")
    lines += ["", "Figures:", ""]
    lines += [f"![{os.path.basename(p)}]({os.path.relpath(p, workdir)})" for p in figure_paths]
    path = os.path.join(workdir, "results.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def run_study(config, workdir: str, command: str) -> str:
    methods, seeds = list(config.study.methods), list(config.study.seeds)
    records = {m: {} for m in methods}
    for seed in seeds:
        for method in methods:
            logging.info(f"== {method}, seed {seed}")
            records[method][seed] = run_one(
                method_config(config, method, seed),
                os.path.join(workdir, "runs", f"{method}_s{seed}"),
            )
    if jax.process_index() != 0:
        return ""
    paths = figures(records, workdir, methods, seeds)
    return write_results(records, workdir, methods, seeds, paths, command)
