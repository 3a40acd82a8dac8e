"""report.md: one table of the headline numbers per suite, the settings, the figures."""

import os


def _pct(value) -> str:
    return "—" if value is None else f"{100 * value:.2f}"


def _num(value) -> str:
    return "—" if value is None else f"{value:.2f}"


def _over255(eps: float) -> str:
    return f"{eps * 255:g}/255"


def _autoattack_rows(result: dict) -> list[tuple[str, str]]:
    """One row per stage of the AutoAttack cascade: robust accuracy after it, and on how
    many points it ran and how many it broke."""
    if not result.get("autoattack"):
        return []
    s = result["settings"]
    eot = f", EOT {s['eot_iter']}" if s["eot_iter"] else ""
    names = {
        "apgd_ce": f"APGD-CE{eot}",
        "apgd_t": f"APGD-T ({s['autoattack_targets']} targets)",
        "fab_t": f"FAB-T ({s['autoattack_targets']} targets)",
        "square": f"Square ({s['square_queries']} queries)",
        "apgd_dlr": f"APGD-DLR{eot}",
    }
    return [
        (
            f"AutoAttack after {names[stage['attack']]} (%)",
            f"{_pct(stage['robust_accuracy'])} (ran on {stage['attacked']}, "
            f"broke {stage['broken']})",
        )
        for stage in result["autoattack"]["stages"]
    ]


def _rows(name: str, result: dict) -> list[tuple[str, str]]:
    """(metric, value) rows of a suite's headline numbers."""
    if "skipped" in result:
        return [("skipped", result["skipped"])]
    if name == "clean":
        return [
            ("top-1 (%)", _pct(result["top1"])),
            ("top-5 (%)", _pct(result["top5"])),
            ("examples", str(result["num_examples"])),
        ]
    if name == "corrupted_local":
        rows = [
            (f"{c} (%, mean over severities)", _pct(a)) for c, a in result["per_corruption"].items()
        ]
        return rows + [
            ("mean accuracy (%)", _pct(result["mean_accuracy"])),
            ("mean accuracy w/o noise (%)", _pct(result["mean_accuracy_no_noise"])),
        ]
    if name == "patch_occlusion":
        dist = result["random_mask_accuracy"]
        rows = [
            ("clean (%)", _pct(result["clean_accuracy"])),
            ("random masks: mean ± std (%)", f"{_pct(dist['mean'])} ± {100 * dist['std']:.2f}"),
            (
                "random masks: min / median / max (%)",
                f"{_pct(dist['min'])} / {_pct(dist['median'])} / {_pct(dist['max'])}",
            ),
        ]
        if "learned_mask_accuracy" in result:
            rows.append(
                ("trained corruption model's mask (%)", _pct(result["learned_mask_accuracy"]))
            )
            chosen = result["selection"]
            rows += [
                ("C: distinct masks", f"{chosen['distinct_masks']} of {result['num_examples']}"),
                (
                    "C: selection entropy (1 = uniform, 0 = one mask)",
                    f"{chosen['entropy']:.3f}",
                ),
                ("C: mean mask IoU of two images", f"{chosen['mask_iou']:.3f}"),
            ]
            if "on_object" in chosen:
                rows.append(("C: selected patches on the object (%)", _pct(chosen["on_object"])))
            if "blank_mask_iou" in chosen:
                rows.append(
                    (
                        "C: mask IoU with its mask of a blank image",
                        f"{chosen['blank_mask_iou']:.3f}",
                    )
                )
        return rows + [
            ("occluded patches", f"{result['occluded_patches']} of {result['num_patches']}"),
            ("masks per image", str(result["masks_per_image"])),
        ]
    if name == "attention_stability":
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
    if name == "imagenet_c":
        rows = [
            (f"{c}: accuracy (%) / CE", f"{_pct(v['accuracy'])} / {_num(v.get('ce'))}")
            for c, v in result["per_corruption"].items()
        ]
        return rows + [
            ("mCE (15)", _num(result["mce"])),
            ("mCE w/o noise (12)", _num(result["mce_no_noise"])),
            ("mean accuracy (15) (%)", _pct(result["mean_accuracy"])),
            ("mean accuracy w/o noise (%)", _pct(result["mean_accuracy_no_noise"])),
            ("mean accuracy (19) (%)", _pct(result["mean_accuracy_19"])),
        ]
    if name in ("cifar10_c", "cifar100_c"):
        if "per_corruption" not in result:
            return [("accuracy (%) per corruption/severity", str(result["accuracy"]))]
        rows = [(f"{c} (%)", _pct(a)) for c, a in result["per_corruption"].items()]
        return rows + [
            ("mean accuracy (15) (%)", _pct(result["mean_accuracy"])),
            ("mean accuracy (19) (%)", _pct(result["mean_accuracy_19"])),
        ]
    if name in ("imagenet_a", "imagenet_r"):
        return [
            ("top-1, 200 classes (%)", _pct(result["top1"])),
            ("examples", str(result["num_examples"])),
        ]
    if name == "imagenet_p":
        rows = [
            (f"{p}: FP (%) / T5D", f"{_pct(fp)} / {result['top5_distance'][p]:.3f}")
            for p, fp in result["flip_probability"].items()
        ]
        rows += [
            (
                "mean FP (%) / mean T5D",
                f"{_pct(result['mean_flip_probability'])} / {result['mean_top5_distance']:.3f}",
            )
        ]
        if "mFR" in result:
            rows += [
                ("mFR / mT5D", f"{_num(result['mFR']['mean'])} / {_num(result['mT5D']['mean'])}")
            ]
        return rows
    if name == "adversarial":
        s, accuracy = result["settings"], result["accuracy"]
        labels = {
            "clean": "clean",
            "fgsm": f"FGSM, eps {_over255(s['fgsm_eps'])}",
            "pgd": f"PGD-{s['pgd_steps']}, eps {_over255(s['pgd_eps'])}, step {_over255(s['pgd_step'])}",
            "apgd_ce": f"APGD-CE, eps {_over255(s['apgd_eps'])}, {s['apgd_iters']} iterations",
            "autoattack": f"AutoAttack {s['autoattack_version']}, eps {_over255(s['apgd_eps'])}",
            "patch_fool": f"Patch-Fool, {s['patch_fool']['patches']} patch, block "
            f"{s['patch_fool']['block']}, {s['patch_fool']['steps']} Adam steps",
        }
        rows = [
            (f"{label} (%)", _pct(accuracy[key]))
            for key, label in labels.items()
            if key in accuracy
        ]
        return rows + _autoattack_rows(result) + [("examples", str(result["num_examples"]))]
    return [(k, str(v)) for k, v in result.items() if not isinstance(v, (dict, list))]


def write(
    out_dir: str,
    results: dict,
    figure_paths: dict,
    *,
    model_name: str,
    dataset: str,
    source: str,
    config,
) -> str:
    lines = [
        f"# Robustness report: {model_name} on {dataset}",
        "",
        f"Weights: `{source}`. Eval preprocessing: "
        f"{config.eval_preprocess or 'the dataset default'} at {config.image_size} px. "
        "Per-suite JSON files beside this report hold every number.",
        "",
    ]
    for name, result in results.items():
        lines += [f"## {name}", "", "| metric | value |", "|---|---|"]
        lines += [f"| {metric} | {value} |" for metric, value in _rows(name, result)]
        lines += ["", f"Time: {result.get('seconds', 0)} s."]
        for key in ("data", "preprocessing", "metric", "note", "definition"):
            if key in result:
                lines += ["", f"{key.capitalize()}: {result[key]}"]
        if name == "adversarial":
            lines += ["", f"Attacks in {result['settings']['space']}."]
        for path in figure_paths.get(name, []):
            rel = os.path.relpath(path, out_dir)
            lines += ["", f"![{os.path.basename(path)}]({rel})"]
        lines.append("")
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path
