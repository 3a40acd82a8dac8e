"""report.md (one table of each suite's headline numbers, its settings and its figures) and
summary.md (the analyses' lines); the rows come from each plug-in's `rows`."""

import os

from rspc_jax.evaluation import registry

# Result keys every suite may carry, printed after its table.
_SETTING_KEYS = ("data", "preprocessing", "metric", "note", "definition")


def pct(value, missing: str = "—") -> str:
    """A fraction as a percentage with two decimals; `missing` for a missing number."""
    return missing if value is None else f"{100 * value:.2f}"


def num(value) -> str:
    return "—" if value is None else f"{value:.2f}"


def over255(eps: float) -> str:
    return f"{eps * 255:g}/255"


def _suite_section(name: str, result: dict, figure_paths: list, out_dir: str) -> list[str]:
    """One suite's heading, table, time, settings, notes and figures."""
    if "skipped" in result:
        rows, notes = [("skipped", result["skipped"])], []
    else:
        plugin = registry.plugin("suite", name)
        rows = plugin.rows(result)
        notes = plugin.notes(result) if hasattr(plugin, "notes") else []
    lines = [f"## {name}", "", "| metric | value |", "|---|---|"]
    lines += [f"| {metric} | {value} |" for metric, value in rows]
    lines += ["", f"Time: {result.get('seconds', 0)} s."]
    lines += [
        line
        for key in _SETTING_KEYS
        if key in result
        for line in ("", f"{key.capitalize()}: {result[key]}")
    ]
    lines += [line for note in notes for line in ("", note)]
    for path in figure_paths:
        lines += ["", f"![{os.path.basename(path)}]({os.path.relpath(path, out_dir)})"]
    return lines + [""]


def write(
    out_dir: str,
    results: dict,
    figure_paths: dict,
    *,
    model_name: str,
    dataset: str,
    source: str,
    config,
    note: str | None = None,
) -> str:
    """Writes <out_dir>/report.md of the suites' `results`; returns its path. `note`: a
    sentence saying that the run's settings changed on the way (interop.run_record)."""
    lines = [
        f"# Robustness report: {model_name} on {dataset}",
        "",
        f"Weights: `{source}`. Eval preprocessing: "
        f"{config.eval_preprocess or 'the dataset default'} at {config.image_size} px. "
        "Per-suite JSON files beside this report hold every number.",
        "",
        *([f"Note: {note}", ""] if note else []),
    ]
    for name, result in results.items():
        lines += _suite_section(name, result, figure_paths.get(name, []), out_dir)
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def analysis_lines(name: str, result: dict) -> list[str]:
    """An analysis's summary lines: its plug-in's rows, or why it was skipped."""
    if "skipped" in result:
        return [f"skipped: {result['skipped']}"]
    return registry.plugin("analysis", name).rows(result)


def write_summary(out_dir: str, heading: str, sections: list[str]) -> str:
    """Writes <out_dir>/summary.md from the analyses' sections; returns its path."""
    path = os.path.join(out_dir, "summary.md")
    with open(path, "w") as f:
        f.write("\n".join([heading, "", *sections]))
    return path
