"""The one driver of the suites and the analyses (plug-ins of `evaluation.registry`) on a
training run or a checkpoint file: loads the weights, runs each plug-in, writes
<out>/<name>.json and <out>/figures/*.png, then report.md (suites; the CLI
`rspc_jax.evaluate`) or summary.md (analyses; the CLI `rspc_jax.analyze`)."""

import json
import os
import time

from absl import logging
import jax

from rspc_jax import ConfigError, models, parallel, rspc
from rspc_jax.data import specs as datasets
from rspc_jax.evaluation import loop as runner
from rspc_jax.evaluation import registry, report, sources
from rspc_jax.interop import checkpoints as checkpointing
from rspc_jax.interop import run_record
from rspc_jax.interop import state_dicts as interop


def load_variables(config, model, *, workdir, checkpoint, step, ema):
    """(variables, corruption-model params or None, description of the source)."""
    if checkpoint:
        variables = interop.init_and_load(model, checkpoint, image_size=config.image_size, ema=ema)
        return variables, None, f"{checkpoint}{' (EMA)' if ema else ''}"
    if not workdir:
        raise ConfigError("pass --workdir (a training run) or --checkpoint (a file)")
    step, state, _ = checkpointing.read_model_state(
        os.path.join(workdir, "checkpoints"),
        step,
        model=model,
        model_name=config.model_name,
        image_size=config.image_size,
    )
    if ema and not state.get("ema_params"):
        raise ConfigError(f"{workdir} kept no EMA; evaluate without --ema")
    variables = dict(params=state["ema_params"] if ema else state["params"])
    batch_stats = (ema and state.get("ema_batch_stats")) or state.get("batch_stats")
    if batch_stats:
        variables["batch_stats"] = batch_stats
    return (
        variables,
        state.get("corruption_params") or None,
        f"{workdir}/checkpoints/{step}{' (EMA)' if ema else ''}",
    )


def build_context(
    config,
    model,
    variables=None,
    corruption_params=None,
    settings=None,
    mesh=None,
    compute_dtype=None,
):
    """The suites' runner.Context (default: on a mesh over every device), with training's
    occlusion noise and clamp; `settings` default config.evaluation."""
    spec = datasets.dataset_spec(config.dataset)
    mesh = mesh or parallel.create_mesh()
    noise_mean, noise_std, lower, upper = rspc.occlusion_fill(config.rspc, spec.mean, spec.std)
    replicated = parallel.replicated(mesh)
    return runner.Context(
        config=config,
        settings=settings or config.evaluation,
        model=model,
        variables=jax.device_put(variables, replicated) if variables is not None else None,
        corruption_params=jax.device_put(corruption_params, replicated)
        if corruption_params is not None
        else None,
        spec=spec,
        mesh=mesh,
        patch_size=rspc.corruption_patch_size(config.rspc, model),
        noise_mean=noise_mean,
        noise_std=noise_std,
        lower=lower,
        upper=upper,
        seed=config.seed,
        compute_dtype=compute_dtype,
    )


def _run_one(kind: str, name: str, ctx: runner.Context) -> tuple[dict, dict]:
    """(result, the arrays of its figures): a plug-in that cannot run here gives
    {'skipped': why}, never a crash of the whole run."""
    start = time.time()
    logging.info(f"== {name}")
    try:
        result = registry.plugin(kind, name).run(ctx)
    except (runner.SuiteSkipped, sources.MissingDataError) as e:
        logging.info(f"[{name}] skipped: {e}")
        result = dict(skipped=str(e))
    arrays = result.pop("figures", {})
    result["seconds"] = round(time.time() - start, 1)
    logging.info(f"[{name}] done in {result['seconds']}s")
    return result, arrays


def _write_one(kind: str, name: str, result: dict, arrays: dict, out: str) -> list[str]:
    """Writes <out>/<name>.json and the plug-in's figures; returns the figures' paths."""
    plugin = registry.plugin(kind, name)
    paths = []
    if "skipped" not in result and hasattr(plugin, "figures"):
        paths = plugin.figures(result, arrays, os.path.join(out, "figures"))
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    return paths


def _changes_note(weights: dict) -> str | None:
    """When the run whose checkpoint `weights` name changed its settings on the way
    (interop.run_record), a sentence saying so, also logged as a warning."""
    if weights["checkpoint"] or not weights["workdir"]:
        return None
    note = run_record.changes_note(weights["workdir"], weights["step"])
    if note:
        logging.warning(f"Note: {note}")
    return note


def _run_all(kind: str, names: list[str], config, settings, weights: dict, out, folder: str):
    """Runs the plug-ins `names` of `kind` on the weights that `weights` (load_variables'
    keywords) name, writing to `out` (default: `folder` beside the weights). Returns
    ({name: result}, {name: figure paths}, the weights' description, the output folder, the
    sentence saying that the run's settings changed on the way or None)."""
    spec = datasets.dataset_spec(config.dataset)
    model = models.from_config(config, spec.num_classes)
    variables, corruption_params, source = load_variables(config, model, **weights)
    note = _changes_note(weights)
    ctx = build_context(config, model, variables, corruption_params, settings=settings)
    out = out or os.path.join(
        weights["workdir"] or os.path.dirname(os.path.abspath(weights["checkpoint"])), folder
    )
    os.makedirs(out, exist_ok=True)
    results, figure_paths = {}, {}
    for name in names:
        results[name], arrays = _run_one(kind, name, ctx)
        if jax.process_index() == 0:
            figure_paths[name] = _write_one(kind, name, results[name], arrays, out)
    return results, figure_paths, source, out, note


def run_suites(
    config, *, workdir=None, checkpoint=None, step=None, ema=False, suites=None, out=None
) -> dict:
    """Runs the comma-separated `suites` (default config.evaluation.suites); returns
    {suite: result} and writes the JSON files, the figures and report.md."""
    names = registry.names("suite", suites or config.evaluation.suites)
    weights = dict(workdir=workdir, checkpoint=checkpoint, step=step, ema=ema)
    results, figure_paths, source, out, note = _run_all(
        "suite", names, config, config.evaluation, weights, out, "eval"
    )
    if jax.process_index() == 0:
        path = report.write(
            out,
            results,
            figure_paths,
            model_name=config.model_name,
            dataset=config.dataset,
            source=source,
            config=config,
            note=note,
        )
        logging.info(f"Report: {path}")
    return results


def run_analyses(
    config, *, analyses: str, workdir=None, checkpoint=None, step=None, ema=False, out=None
) -> dict:
    """Runs the comma-separated `analyses` (settings: config.analysis); returns
    {analysis: result}, prints each one's lines and writes the JSON files, the figures and
    summary.md."""
    names = registry.names("analysis", analyses)
    weights = dict(workdir=workdir, checkpoint=checkpoint, step=step, ema=ema)
    results, figure_paths, source, out, note = _run_all(
        "analysis", names, config, config.analysis, weights, out, "analysis"
    )
    sections = [f"Note: {note}", ""] if note else []
    for name, result in results.items():
        lines = report.analysis_lines(name, result)
        print("\n".join(lines), flush=True)
        sections += [f"## {name} ({result['seconds']} s)", "", *lines, ""]
        for path in figure_paths.get(name, []):
            sections += [f"![{name}]({os.path.relpath(path, out)})", ""]
    if jax.process_index() == 0:
        heading = f"# Analyses of {config.model_name} ({source}) on {config.dataset}"
        path = report.write_summary(out, heading, sections)
        logging.info(f"Summary: {path}")
    return results
