"""The small-scale study behind `python -m rspc_jax.study` (configs/demo_study.py).

For every seed of config.study.seeds, every setting of config.study.settings (a partial config
merged into the base) and every method of that setting ('rspc' or a name of
rspc_jax.training.ablations, then optional `field=value` overrides of config.rspc), trains one
run, evaluates it with config.evaluation's suites and records its numbers. Then writes
DIR/results.md (mean ± std over seeds; learned against random selection per lambda, paired by
seed; C's selection statistics and lambda * L_align / CE; the command, hardware and wall-clock)
and DIR/figures/. Runs live in DIR/runs/<setting>/<method>_s<seed>; a finished run is not
trained or evaluated again, so an interrupted study resumes where it stopped.

A study can run in parts (`run_study(settings=..., seeds=...)`, the CLI's `--settings` and
`--seeds`): each part trains its runs and logs its wall-clock to DIR/study_parts.jsonl, and the
report covers every setting and seed whose runs are all finished. With the corruption suite
(`corrupted_local`) the report adds unseen-corruption accuracy and its error relative to plain
training, and every paired difference (learned - random, method - plain) with its standard
error and per-seed values. With `config.study.transfer` (a method and a seed outside the
study's) each setting first trains that run once, and every run of the setting is evaluated
under its C's masks (`transfer_occlusion`), the same adversary for every method.
"""

import ast
import json
import os
import platform
import shutil
import time

from absl import logging
import jax
import numpy as np

from rspc_jax import ReportedError
from rspc_jax.interop import run_record
from rspc_jax.training import reporting

LABELS = {
    "clean": "plain",
    "rspc": "RSPC",
    "random_patches": "RSPC, random patches",
    "random_object_patches": "RSPC, random patches on the digit",
    "attended_patches": "RSPC, the most attended patches",
    "random_attended_patches": "RSPC, random patches among the most attended",
    "clean_and_corrupted": "clean + corrupted",
}
# The methods of the README's headline table (those present in a setting).
HEADLINE = (
    "clean",
    "rspc",
    "random_patches",
    "clean_and_corrupted",
    "rspc lam=0.5",
    "random_patches lam=0.5",
)


def parse_method(method: str) -> tuple[str, dict]:
    """'random_patches lam=0.5' -> ('random_patches', {'lam': 0.5})."""
    name, *overrides = method.split()
    fields = {}
    for override in overrides:
        key, _, value = override.partition("=")
        try:
            fields[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            fields[key] = value
    return name, fields


def label(method: str) -> str:
    name, fields = parse_method(method)
    text = LABELS.get(name, name)
    return text + "".join(f", {'λ' if k == 'lam' else k}={v}" for k, v in fields.items())


def _slug(method: str) -> str:
    return method.replace(" ", "_")


def _merge(config, partial) -> None:
    for key, value in partial.items():
        if hasattr(value, "items") and hasattr(config[key], "items"):
            _merge(config[key], value)
        else:
            config[key] = value


def check(config) -> None:
    """Unknown methods or rspc fields fail before the first run trains."""
    from rspc_jax import ConfigError
    from rspc_jax.training import ablations

    for setting, spec in config.study.settings.items():
        for method in spec.methods:
            name, fields = parse_method(method)
            unknown = [k for k in fields if k not in config.rspc]
            if (name != "rspc" and name not in ablations.ABLATIONS) or unknown:
                raise ConfigError(
                    f"study setting {setting!r}: method {method!r} is not "
                    "'rspc' or an ablation name followed by config.rspc fields as field=value "
                    f"(ablations: {sorted(ablations.ABLATIONS)}; unknown fields: {unknown}). "
                    "Fix config.study.settings."
                )
    _check_transfer(config)


def _check_transfer(config) -> None:
    """The transfer source (config.study.transfer: method, seed) must learn its masks and
    be trained independently of the runs it attacks: a seed the study does not use."""
    from rspc_jax import ConfigError

    transfer = config.study.get("transfer")
    if not transfer:
        return
    name, fields = parse_method(transfer.method)
    if name != "rspc" or fields.get("selection", "learned") != "learned":
        raise ConfigError(
            f"config.study.transfer.method {transfer.method!r} learns no masks; name an 'rspc' "
            "method (e.g. 'rspc lam=0.5 corruption_model=content temperature=1.0')."
        )
    if transfer.seed in config.study.seeds:
        raise ConfigError(
            f"config.study.transfer.seed {transfer.seed} is one of the study's seeds "
            f"{tuple(config.study.seeds)}; the source must be trained independently of the "
            "runs it attacks: choose another seed."
        )


def run_config(config, setting: str, method: str, seed: int):
    """The base config switched to `setting`, `method` and `seed`."""
    from rspc_jax.training import ablations

    config = config.copy_and_resolve_references()
    _merge(config, config.study.settings[setting].config)
    config.seed = seed
    name, fields = parse_method(method)
    if name == "rspc":
        config.rspc.enabled = True
    else:
        ablations.apply(config, name)
    for key, value in fields.items():
        config.rspc[key] = type(config.rspc[key])(value)
    return config


def run_one(config, workdir: str, reevaluate=(), accept_config_change: bool = False) -> dict:
    """Trains (unless finished) and evaluates one run; its record. A finished run is
    evaluated only with the suites of config.evaluation.suites its record lacks and those in
    `reevaluate` (`_evaluate_again`). `accept_config_change`: a run resumed with settings
    that change what it trains goes on, the change recorded (else it is refused)."""
    from rspc_jax.evaluation import run_suites as evaluation_run
    from rspc_jax.training import loop as train

    record_path = os.path.join(workdir, "study_run.json")
    if os.path.exists(record_path):
        with open(record_path) as f:
            return _evaluate_again(config, workdir, json.load(f), reevaluate)
    start = time.time()
    done = train.train_and_evaluate(config, workdir, accept_config_change=accept_config_change)
    if done["step"] < done["total_steps"]:
        raise ReportedError(
            f"the study stopped (SIGTERM or Ctrl-C) in the run {workdir} at step {done['step']} "
            f"of {done['total_steps']}: its checkpoint is saved, and it is neither evaluated nor "
            "recorded as finished. Rerun the same command to resume it and the study where they "
            "stopped."
        )
    trained = time.time()
    results = evaluation_run.run_suites(config, workdir=workdir, out=os.path.join(workdir, "eval"))
    train_log = [
        r
        for r in reporting.read_metrics(os.path.join(workdir, "metrics.jsonl"))
        if "train/loss" in r
    ]
    record = dict(
        train_seconds=round(trained - start, 1),
        eval_seconds=round(time.time() - trained, 1),
        results=results,
        train_log=train_log,
    )
    _write_record(record_path, record)
    return record


def _write_record(path: str, record: dict) -> None:
    """Process 0 writes the record whole or not at all (a new file renamed over the old)."""
    if jax.process_index() == 0:
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)


def _evaluate_again(config, workdir: str, record: dict, reevaluate) -> dict:
    """The finished run's record with the suites it lacks, and those in `reevaluate`,
    evaluated on its final checkpoint (to <run>/eval/<suites>/, the first report kept) and
    their results replaced; evaluate seconds added, the suites listed under 'reevaluated'."""
    from rspc_jax.evaluation import run_suites as evaluation_run

    wanted = [s for s in config.evaluation.suites.split(",") if s]
    names = [s for s in wanted if s not in record["results"] or s in (reevaluate or ())]
    if not names:
        return record
    start = time.time()
    out = os.path.join(workdir, "eval", "+".join(names))
    results = evaluation_run.run_suites(config, workdir=workdir, suites=",".join(names), out=out)
    record["results"].update(results)
    record["eval_seconds"] = round(record["eval_seconds"] + time.time() - start, 1)
    record["reevaluated"] = sorted(set(record.get("reevaluated", [])) | set(names))
    _write_record(os.path.join(workdir, "study_run.json"), record)
    return record


def summarise(record: dict) -> dict:
    """The study's numbers of one run."""
    results, log = record["results"], record["train_log"]
    row = dict(clean=results["clean"]["top1"])
    occlusion = results["patch_occlusion"]
    row["occluded"] = occlusion["random_mask_accuracy"]["mean"]
    row["worst mask"] = occlusion["random_mask_accuracy"]["min"]
    if "every_mask_accuracy" in occlusion:
        row["every mask"] = occlusion["every_mask_accuracy"]["mean"]
        row["worst case"] = occlusion["every_mask_accuracy"]["worst_case"]
    if "corrupted_local" in results:
        row["corruptions"] = results["corrupted_local"]["mean_accuracy"]
    for suite, metric in (("adaptive_occlusion", "greedy"), ("transfer_occlusion", "transfer")):
        if "accuracy" in results.get(suite, {}):  # not where the suite was skipped
            row[metric] = results[suite]["accuracy"]
    by_patches = results.get("adaptive_occlusion", {}).get("accuracy_by_patches", [])
    if len(by_patches) > 1:
        row["greedy, 1 patch"] = by_patches[0]
    if "attention_stability" in results:
        row["Cos-Sim"] = results["attention_stability"]["mean_cos_sim"]
    if "train/weighted_align_to_ce" in log[-1]:
        row["λ·L_align/CE"] = log[-1]["train/weighted_align_to_ce"]
    if "train/selection_entropy" in log[0]:
        row["entropy, first log"] = log[0]["train/selection_entropy"]
        row["entropy, last log"] = log[-1]["train/selection_entropy"]
    on_object = [r["train/selection_on_object"] for r in log if "train/selection_on_object" in r]
    if on_object:  # the training masks' share on the object (C's, random, attended)
        row["on object, training"] = float(np.mean(on_object))
        row["on object, last log"] = on_object[-1]
    chosen = occlusion.get("selection")
    if chosen:  # C's masks on the test set (for random selection: C as initialised)
        row["C's mask: accuracy"] = occlusion["learned_mask_accuracy"]
        row["C: distinct masks"] = chosen["distinct_masks"]
        row["C: entropy"] = chosen["entropy"]
        row["C: mask IoU"] = chosen["mask_iou"]
        row["C: modal mask share"] = chosen["modal_mask_share"]
        if "on_object" in chosen:
            row["C: on object"] = chosen["on_object"]
        if "blank_mask_iou" in chosen:
            row["C: IoU with blank's mask"] = chosen["blank_mask_iou"]
    return row


def corruption_error(result: dict, reference: dict) -> float:
    """ImageNet-C's mCE with `reference` (plain training) in AlexNet's place: per corruption,
    the error summed over severities over the reference's, averaged over the corruptions (1 =
    as robust as plain training, below 1 = more). Both are `corrupted_local` results."""

    def error(r, name):
        return sum(1 - r["accuracy"][f"{name}/{s}"] for s in r["severities"])

    return float(
        np.mean([error(result, c) / max(error(reference, c), 1e-12) for c in result["corruptions"]])
    )


def add_corruption_errors(rows: dict, records: dict) -> None:
    """Adds 'mCE vs plain' to every run of a setting whose plain run ('clean') of the same
    seed has the corruption suite."""
    for setting, methods in records.items():
        for method, per_seed in methods.items():
            for row, seed in zip(rows[setting][method], per_seed, strict=True):
                plain = methods.get("clean", {}).get(seed)
                if plain and "corrupted_local" in per_seed[seed]["results"]:
                    row["mCE vs plain"] = corruption_error(
                        per_seed[seed]["results"]["corrupted_local"],
                        plain["results"]["corrupted_local"],
                    )


# Shown in percent; the rest as they are.
PERCENT = (
    "clean",
    "occluded",
    "corruptions",
    "mCE vs plain",
    "worst mask",
    "every mask",
    "worst case",
    "greedy",
    "greedy, 1 patch",
    "transfer",
    "Cos-Sim",
    "C's mask: accuracy",
    "C: on object",
    "on object, training",
    "on object, last log",
)


def _cell(values, metric: str) -> str:
    values = np.asarray(values, float) * (100 if metric in PERCENT else 1)
    digits = 0 if metric == "C: distinct masks" else (2 if metric in PERCENT else 3)
    if metric == "λ·L_align/CE":
        text = f"{values.mean():.2g}"
        return text + (f" ± {values.std(ddof=1):.1g}" if len(values) > 1 else "")
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{values.mean():.{digits}f} ± {values.std(ddof=1):.{digits}f}"


def _table(rows: dict, metrics: list, first_column: str) -> list[str]:
    lines = [
        f"| {first_column} | " + " | ".join(metrics) + " |",
        "|---|" + "---:|" * len(metrics),
    ]
    for name, per_seed in rows.items():
        cells = [
            _cell([r[m] for r in per_seed], m) if all(m in r for r in per_seed) else "—"
            for m in metrics
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


# config.rspc fields that change only how C selects: random selection ignores them, so a
# learned method with them pairs with the random-patch method that has its other fields.
SELECTION_FIELDS = (
    "corruption_model",
    "temperature",
    "ste",
    "corruption_grad_scale",
    "learned_fraction",
    "learned_fraction_ramp_epochs",
    "learned_batch_fraction",
    "corruption_warmup_epochs",
    "corruption_curriculum_epochs",
    "corruption_diversity",
    "attended_pool",
)


def random_twin(method: str, random: str = "random_patches") -> str:
    """'rspc lam=0.5 corruption_model=content' -> 'random_patches lam=0.5' (or the method
    `random` names: 'random_object_patches', random patches on the object)."""
    kept = [f for f in method.split()[1:] if f.partition("=")[0] not in SELECTION_FIELDS]
    return " ".join([random, *kept])


# The paired differences the study reports, where both runs have them: randomly occluded,
# unseen corruptions (mean accuracy, mCE vs plain), the worst case over every mask, the
# greedy adaptive masks, the transfer source's masks, clean.
PAIRED = (
    "occluded",
    "corruptions",
    "mCE vs plain",
    "worst case",
    "greedy",
    "greedy, 1 patch",
    "transfer",
    "clean",
    "Cos-Sim",
)


def _differences(runs: list, references: list) -> dict:
    """{metric: [run - reference, per seed]} for the metrics of PAIRED both have."""
    return {
        metric: [a[metric] - b[metric] for a, b in zip(runs, references, strict=True)]
        for metric in PAIRED
        if all(metric in r for r in runs + references)
    }


def learned_vs_random(rows: dict, random: str = "random_patches") -> list[tuple]:
    """(method, {metric: difference learned - random per seed}) for every learned method and
    the random-patch method (`random`) it differs from only in the selection (metrics of
    PAIRED)."""
    return [
        (method, _differences(rows[method], rows[random_twin(method, random)]))
        for method in rows
        if parse_method(method)[0] == "rspc" and random_twin(method, random) in rows
    ]


# The selections that read the classifier's attention (docs/method.md, "Occluding what the
# classifier attends to"), paired with random patches, random patches on the digit and the
# content C that differ from them only in the selection.
ATTENTION = ("attended_patches", "random_attended_patches")


def _content_c_twin(method: str, rows: dict) -> str | None:
    """The content C's method of `rows` with `method`'s other fields, if it ran."""
    twin = random_twin(method)
    for other in rows:
        name, fields = parse_method(other)
        if name == "rspc" and fields.get("corruption_model") == "content":
            if random_twin(other) == twin:
                return other
    return None


def attention_against(rows: dict, partner: str) -> list[tuple]:
    """(method, {metric: difference attention selection - partner per seed}) for every
    attention selection of `rows`; `partner` is 'random_patches', 'random_object_patches' or
    'content' (the content C)."""
    pairs = []
    for method in rows:
        if parse_method(method)[0] not in ATTENTION:
            continue
        other = (
            _content_c_twin(method, rows) if partner == "content" else random_twin(method, partner)
        )
        if other in rows:
            pairs.append((method, _differences(rows[method], rows[other])))
    return pairs


def against_plain(rows: dict) -> list[tuple]:
    """(method, {metric: difference method - plain per seed}) for every method of a setting
    with plain training ('clean')."""
    if "clean" not in rows:
        return []
    return [(m, _differences(rows[m], rows["clean"])) for m in rows if m != "clean"]


def figures(records: dict, config, workdir: str) -> list[str]:
    """Per reported setting: C's per-position selection frequency over training (first seed, every
    method with learned selection); occluded accuracy per method; C's masks, copied."""
    from rspc_jax.evaluation.figures import plt, save

    out = os.path.join(workdir, "figures")
    paths = []
    for setting in records:
        spec, seeds = config.study.settings[setting], _seeds(records[setting])
        first = seeds[0]
        learned = [
            m
            for m in spec.methods
            if "train/selection_frequency" in records[setting][m][first]["train_log"][-1]
            and parse_method(m)[0] == "rspc"
        ]
        if learned:
            fig, axes = plt.subplots(
                1, len(learned), figsize=(2.6 * len(learned) + 1, 3.2), squeeze=False
            )
            for ax, method in zip(axes[0], learned, strict=True):
                log = records[setting][method][first]["train_log"]
                frequency = np.array([r["train/selection_frequency"] for r in log]).T
                steps = [r["step"] for r in log]
                image = ax.imshow(
                    frequency,
                    aspect="auto",
                    cmap="magma",
                    vmin=0,
                    vmax=1,
                    interpolation="nearest",
                    extent=(steps[0], steps[-1], frequency.shape[0] - 0.5, -0.5),
                )
                ax.set_title(label(method), fontsize=8)
                ax.set_xlabel("step", fontsize=8)
            axes[0, 0].set_ylabel("patch position (row-major)", fontsize=8)
            fig.colorbar(image, ax=axes[0, -1], label="fraction of the batch's masks")
            fig.suptitle(f"{setting}: C's selection per position over training", fontsize=9)
            paths.append(save(fig, out, f"{setting}_selection_over_training.png"))
        methods = list(spec.methods)
        means = [
            [100 * summarise(records[setting][m][s])["occluded"] for s in seeds] for m in methods
        ]
        fig, ax = plt.subplots(figsize=(0.55 * len(methods) + 2, 3.6))
        ax.errorbar(
            range(len(methods)),
            [np.mean(v) for v in means],
            yerr=[np.std(v, ddof=1) if len(v) > 1 else 0 for v in means],
            fmt="o",
            capsize=3,
        )
        ax.set_xticks(range(len(methods)), [label(m) for m in methods], rotation=60, ha="right")
        ax.tick_params(axis="x", labelsize=7)
        ax.set_ylabel("randomly occluded accuracy (%)")
        ax.set_title(f"{setting}: mean ± std over seeds", fontsize=9)
        paths.append(save(fig, out, f"{setting}_occluded_accuracy.png"))
        paths += _copy_mask_figures(workdir, setting, learned, first)
    return paths


def _copy_mask_figures(workdir: str, setting: str, learned: list, seed: int) -> list[str]:
    """Each learned method's figure of C's masks on test images (seed `seed`), copied to
    figures/ (the first method's as <setting>_learned_masks.png, as before)."""
    paths = []
    for index, method in enumerate(learned):
        source = os.path.join(
            workdir, "runs", setting, f"{_slug(method)}_s{seed}", "eval", "figures"
        )
        source = os.path.join(source, "learned_masks.png")
        if os.path.exists(source):
            name = "" if index == 0 else f"_{_slug(method)}"
            target = os.path.join(workdir, "figures", f"{setting}{name}_learned_masks.png")
            shutil.copyfile(source, target)
            paths.append(target)
    return paths


def _seeds(methods: dict) -> list:
    """The seeds of one setting's records (every method has the same)."""
    return sorted(next(iter(methods.values())))


def write_results(records: dict, config, workdir: str, figure_paths, command: str) -> str:
    """Writes DIR/results.md from the runs' `records` (setting -> method -> seed -> record,
    each setting with the seeds it has finished); returns its path."""
    settings = {s: config.study.settings[s] for s in records}
    rows = {
        setting: {m: [summarise(r[s]) for s in _seeds(records[setting])] for m, r in runs.items()}
        for setting, runs in records.items()
    }
    add_corruption_errors(rows, records)
    seconds = {
        (setting, m, s): r[s]["train_seconds"] + r[s]["eval_seconds"]
        for setting, runs in records.items()
        for m, r in runs.items()
        for s in r
    }
    seeds = {setting: _seeds(runs) for setting, runs in records.items()}
    lines = [
        *_introduction(command, seeds, seconds),
        *_parts(workdir),
        *_headline(rows, settings),
        *_paired_tables(rows, settings),
        *_transfer_sources(config, workdir, settings),
        *_changed_settings(records, workdir),
        *_per_setting(rows, settings),
        *_wall_clock(seconds, settings, sorted(set().union(*seeds.values()))),
        "",
        "## Figures",
        "",
        *(f"![{os.path.basename(p)}]({os.path.relpath(p, workdir)})" for p in figure_paths),
    ]
    path = os.path.join(workdir, "results.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _changed_settings(records: dict, workdir: str) -> list[str]:
    """The runs whose settings changed on the way (resumed with `--accept_config_change`),
    each with its changes and steps; nothing when every run kept its settings."""
    notes = [
        run_record.changes_note(_run_dir(workdir, setting, method, seed))
        for setting, runs in records.items()
        for method, by_seed in runs.items()
        for seed in by_seed
    ]
    notes = [note for note in notes if note]
    if not notes:
        return []
    return ["## Runs whose settings changed on the way", "", *(f"- {n}" for n in notes), ""]


def _introduction(command: str, seeds: dict, seconds: dict) -> list[str]:
    """The title, the command, the machine and what the columns mean."""
    return [
        "# Small-scale study: learned against random patch selection on the digits",
        "",
        f"Written by: `{command}` (every invocation that ran in this workdir: 'Parts', below)",
        "",
        f"Hardware: {platform.machine()} CPU, {os.cpu_count()} cores; "
        f"JAX {jax.__version__} on {jax.device_count()} x {jax.devices()[0].device_kind}; "
        f"Python {platform.python_version()}. {len(seconds)} runs; wall-clock of all runs "
        f"(train + evaluate): {sum(seconds.values()) / 60:.1f} min.",
        "",
        "Seeds: " + "; ".join(f"{k} {v}" for k, v in seeds.items()) + ". "
        "Every number is mean ± std over the seeds. Accuracies and Cos-Sim in "
        "percent. 'occluded': mean accuracy over the random masks of each test image; "
        "'corruptions': mean accuracy over the corruptions × severities of `corrupted_local` "
        "(never trained on), 'mCE vs plain' its corruption error relative to plain training "
        "of the same seed (ImageNet-C's mCE with plain training in AlexNet's place; 100 = "
        "plain); "
        "'every mask' and 'worst case' (where there are few enough masks): the mean accuracy "
        "over every mask of that many patches, and the share of images classified correctly "
        "under every one of them; 'greedy': accuracy under masks searched per image "
        "against the model (`adaptive_occlusion`, k·N + k forward passes for k of N "
        "patches; an upper bound on the worst case), 'greedy, 1 patch' its first round (the "
        "exact worst case over single patches); 'transfer': accuracy under the masks of "
        "one fixed, independently trained C (the setting's transfer source, below), the same "
        "adversary for every method; λ·L_align/CE and the training entropies come from the "
        "training log (the first and the last log step); the 'C:' columns describe C's masks "
        "on the test set (with random selection C is never updated, so they show C at "
        "initialisation): distinct masks (of the test images), entropy of the per-position "
        "frequency (1 = uniform, 0 = one mask), mean IoU of two images' masks, share of the "
        "images that get the most common mask, fraction of selected patches on the digit.",
        "",
    ]


def _headline(rows: dict, settings) -> list[str]:
    """Randomly occluded accuracy of the HEADLINE methods, one column per setting."""
    lines = [
        "## Headline: randomly occluded accuracy (%)",
        "",
        "| method | " + " | ".join(settings) + " |",
        "|---|" + "---:|" * len(settings),
    ]
    for method in HEADLINE:
        if not any(method in spec.methods for spec in settings.values()):
            continue
        cells = [
            _cell([r["occluded"] for r in rows[s][method]], "occluded")
            if method in rows[s]
            else "—"
            for s in settings
        ]
        lines.append(f"| {label(method)} | " + " | ".join(cells) + " |")
    return lines


def _paired_cell(values) -> str:
    """Paired differences in points: mean ± std (SE = std / sqrt(seeds); each seed's)."""
    values = 100 * np.asarray(values, float)
    each = ", ".join(f"{v:+.2f}" for v in values)
    if len(values) == 1:
        return each
    std = values.std(ddof=1)
    return f"{values.mean():+.2f} ± {std:.2f} (SE {std / np.sqrt(len(values)):.2f}; {each})"


def _paired_table(title: str, about: str, pairs: dict) -> list[str]:
    """One row per setting and method of `pairs` (setting -> [(method, differences)]), one
    column per metric of PAIRED that any pair has."""
    metrics = [m for m in PAIRED if any(m in d for pair in pairs.values() for _, d in pair)]
    lines = [
        "",
        f"## {title} (paired by seed, points)",
        "",
        about,
        "",
        "| setting | method | " + " | ".join(metrics) + " |",
        "|---|---|" + "---:|" * len(metrics),
    ]
    for setting, pair in pairs.items():
        for method, differences in pair:
            cells = [_paired_cell(differences[m]) if m in differences else "—" for m in metrics]
            lines.append(f"| {setting} | {label(method)} | " + " | ".join(cells) + " |")
    return lines


def _paired_tables(rows: dict, settings) -> list[str]:
    """Each learned method minus its random-patch twin, and every method minus plain."""
    about = (
        "Each cell: mean ± std over seeds of the paired difference (SE: std / √seeds; then "
        "each seed's). 'mCE vs plain' is in points of the relative corruption error."
    )
    learned = {s: learned_vs_random(rows[s]) for s in settings}
    on_object = {s: learned_vs_random(rows[s], "random_object_patches") for s in settings}
    plain = {s: against_plain(rows[s]) for s in settings}
    lines = _paired_table("Learned against random selection", about, learned)
    if any(on_object.values()):  # the control for a C that selects the object
        lines += _paired_table("Learned against random patches on the digit", about, on_object)
    for partner, title in (
        ("random_patches", "random patches"),
        ("random_object_patches", "random patches on the digit"),
        ("content", "the content C"),
    ):
        attention = {s: attention_against(rows[s], partner) for s in settings}
        if any(attention.values()):
            lines += _paired_table(f"The classifier's attention against {title}", about, attention)
    return lines + _paired_table("Against plain training", about, plain)


def _transfer_sources(config, workdir: str, settings) -> list[str]:
    """Each setting's transfer source: which run it is and what its own masks do to it."""
    transfer = config.study.get("transfer")
    if not transfer:
        return []
    lines = [
        "",
        "## Transfer sources",
        "",
        f"'transfer' is accuracy under the masks of {label(transfer.method)}, seed "
        f"{transfer.seed}: trained on the setting like the study's runs but on no study seed, "
        "the same masks for every method.",
        "",
    ]
    for setting in settings:
        path = os.path.join(_source_dir(workdir, setting, transfer), "study_run.json")
        if not os.path.exists(path):
            lines.append(f"- {setting}: not trained")
            continue
        with open(path) as f:
            row = summarise(json.load(f))
        own = 100 * row["C's mask: accuracy"]
        on_digit = ""
        if "C: on object" in row:
            on_digit = f", {100 * row['C: on object']:.1f}% of them on the digit"
        lines.append(
            f"- {setting}: clean {100 * row['clean']:.2f}%, randomly occluded "
            f"{100 * row['occluded']:.2f}%, under its own masks {own:.2f}% "
            f"({row['C: distinct masks']} distinct masks{on_digit})"
        )
    return lines


def _per_setting(rows: dict, settings) -> list[str]:
    """One table per setting: every number of every method."""
    lines = []
    for setting, spec in settings.items():
        metrics = list(dict.fromkeys(k for m in spec.methods for r in rows[setting][m] for k in r))
        lines += ["", f"## {setting}: {spec.about}", ""]
        lines += _table({label(m): rows[setting][m] for m in spec.methods}, metrics, "method")
    return lines


def _wall_clock(seconds: dict, settings, seeds: list) -> list[str]:
    """Train + evaluate seconds of each run."""
    lines = [
        "",
        "## Wall-clock per run (seconds, train + evaluate)",
        "",
        "| setting | method | " + " | ".join(f"seed {s}" for s in seeds) + " |",
        "|---|---|" + "---:|" * len(seeds),
    ]
    for setting, spec in settings.items():
        for m in spec.methods:
            cells = [
                f"{seconds[setting, m, s]:.0f}" if (setting, m, s) in seconds else "—"
                for s in seeds
            ]
            lines.append(f"| {setting} | {label(m)} | " + " | ".join(cells) + " |")
    return lines


def select(config, settings=None, seeds=None) -> tuple[list, list]:
    """The settings and seeds to run now (`--settings`, `--seeds`; default: the config's)."""
    from rspc_jax import ConfigError

    settings = list(settings or config.study.settings)
    unknown = [s for s in settings if s not in config.study.settings]
    if unknown:
        raise ConfigError(
            f"--settings {unknown} are not settings of this study: {sorted(config.study.settings)}"
        )
    return settings, [int(s) for s in (seeds or config.study.seeds)]


def _run_dir(workdir: str, setting: str, method: str, seed: int) -> str:
    return os.path.join(workdir, "runs", setting, f"{_slug(method)}_s{seed}")


def _source_dir(workdir: str, setting: str, transfer) -> str:
    name = f"transfer_source_{_slug(transfer.method)}_s{transfer.seed}"
    return os.path.abspath(os.path.join(workdir, "runs", setting, name))


def transfer_source(config, workdir: str, setting: str) -> str:
    """Trains (unless finished) the setting's transfer source, config.study.transfer's method
    and seed, evaluated clean and with its own masks; its run directory ('' without one)."""
    transfer = config.study.get("transfer")
    if not transfer:
        return ""
    path = _source_dir(workdir, setting, transfer)
    logging.info(f"== {setting}: transfer source {transfer.method}, seed {transfer.seed}")
    source = run_config(config, setting, transfer.method, transfer.seed)
    source.evaluation.suites = "clean,patch_occlusion"
    run_one(source, path)
    return path


def finished(config, workdir: str, seeds) -> dict:
    """setting -> method -> seed -> record of every finished seed (all methods of a setting
    done) among `seeds`; settings without one are left out."""
    records = {}
    for setting, spec in config.study.settings.items():
        for seed in sorted(seeds):
            paths = {m: _run_dir(workdir, setting, m, seed) for m in spec.methods}
            paths = {m: os.path.join(p, "study_run.json") for m, p in paths.items()}
            if all(os.path.exists(p) for p in paths.values()):
                for method, path in paths.items():
                    with open(path) as f:
                        records.setdefault(setting, {}).setdefault(method, {})[seed] = json.load(f)
    return records


PARTS = "study_parts.jsonl"


def _log_part(workdir: str, command: str, settings, seeds, seconds: float) -> None:
    """One line per invocation: what it ran and its wall-clock (the report's 'Parts')."""
    with open(os.path.join(workdir, PARTS), "a") as f:
        part = dict(command=command, settings=settings, seeds=seeds, seconds=round(seconds))
        f.write(json.dumps(part) + "\n")


def _parts(workdir: str) -> list[str]:
    """The report's list of the invocations that ran this study, with their wall-clock."""
    path = os.path.join(workdir, PARTS)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        parts = [json.loads(line) for line in f]
    lines = ["## Parts (wall-clock of each invocation)", ""]
    lines += [
        f"- `{p['command']}`: settings {', '.join(p['settings'])}, seeds "
        f"{', '.join(map(str, p['seeds']))}: {p['seconds'] / 60:.1f} min"
        for p in parts
    ]
    return lines + [""]


def run_study(
    config,
    workdir: str,
    command: str,
    settings=None,
    seeds=None,
    reevaluate=None,
    accept_config_change: bool = False,
) -> str:
    """Trains and evaluates `settings` x `seeds` (default: all of the config), then reports
    every setting and seed finished in `workdir` (by this or earlier invocations). Finished
    runs get the suites they lack and those named in `reevaluate`; unfinished runs resume,
    with changed settings only given `accept_config_change` (`run_one`)."""
    check(config)
    settings, seeds = select(config, settings, seeds)
    start = time.time()
    sources = {setting: transfer_source(config, workdir, setting) for setting in settings}
    for seed in seeds:
        for setting in settings:
            for method in config.study.settings[setting].methods:
                logging.info(f"== {setting}: {method}, seed {seed}")
                run = run_config(config, setting, method, seed)
                run.evaluation.transfer_from = sources[setting]
                run_dir = _run_dir(workdir, setting, method, seed)
                run_one(run, run_dir, reevaluate, accept_config_change)
    if jax.process_index() != 0:
        return ""
    _log_part(workdir, command, settings, seeds, time.time() - start)
    records = finished(config, workdir, set(config.study.seeds) | set(seeds))
    paths = figures(records, config, workdir)
    return write_results(records, config, workdir, paths, command)
