"""Runs the suites of a training run or a checkpoint file and writes the JSON files, the
report and the figures; the CLI is `rspc_jax.evaluate`."""

import json
import os
import time

import jax

from rspc_jax import checkpointing
from rspc_jax import input_pipeline
from rspc_jax import interop
from rspc_jax import parallel
from rspc_jax import train
from rspc_jax.evaluation import benchmarks
from rspc_jax.evaluation import figures
from rspc_jax.evaluation import report
from rspc_jax.evaluation import runner
from rspc_jax.evaluation import sources
from rspc_jax.evaluation import suites as suites_lib


def load_variables(config, model, *, workdir, checkpoint, step, ema):
    """(variables, corruption-model params or None, description of the source)."""
    if checkpoint:
        variables = interop.init_and_load(model, checkpoint, image_size=config.image_size, ema=ema)
        return variables, None, f"{checkpoint}{' (EMA)' if ema else ''}"
    if not workdir:
        raise ValueError("pass --workdir (a training run) or --checkpoint (a file)")
    step, state, meta = checkpointing.read_saved_state(os.path.join(workdir, "checkpoints"), step)
    if meta.get("model_name") != config.model_name:
        raise checkpointing.CheckpointMismatchError(
            f"{workdir} step {step} holds {meta.get('model_name')!r} but the config builds "
            f"{config.model_name!r}; pass the run's config")
    if ema and not state.get("ema_params"):
        raise ValueError(f"{workdir} kept no EMA; evaluate without --ema")
    variables = dict(params=state["ema_params"] if ema else state["params"])
    if state.get("batch_stats"):
        variables["batch_stats"] = state["batch_stats"]
    return (variables, state.get("occ_params") or None,
            f"{workdir}/checkpoints/{step}{' (EMA)' if ema else ''}")


def build_context(config, model, variables, occ_params=None, settings=None):
    """The suites' runner.Context on a mesh over every device, with training's
    occlusion noise and clamp; `settings` default config.evaluation."""
    spec = input_pipeline.dataset_spec(config.dataset)
    mesh = parallel.create_mesh()
    step_settings = train.step_settings(config, spec)
    replicated = parallel.replicated(mesh)
    return runner.Context(
        config=config, settings=settings or config.evaluation, model=model,
        variables=jax.device_put(variables, replicated),
        occ_params=jax.device_put(occ_params, replicated) if occ_params is not None else None,
        spec=spec, mesh=mesh, patch_size=train.rspc_patch_size(config, model),
        noise_mean=step_settings.noise_mean, noise_std=step_settings.noise_std,
        lower=step_settings.clamp_lower, upper=step_settings.clamp_upper, seed=config.seed)


def evaluate(config, *, workdir=None, checkpoint=None, step=None, ema=False, suites=None,
             out=None) -> dict:
    """Runs the suites; returns {suite: result} and writes the files."""
    available = {**suites_lib.SUITES, **benchmarks.SUITES}
    names = [s for s in (suites or config.evaluation.suites).split(",") if s]
    unknown = sorted(set(names) - set(available))
    if unknown:
        raise ValueError(f"unknown suites {unknown}; choose from {sorted(available)}")
    spec = input_pipeline.dataset_spec(config.dataset)
    model = train.build_model(config, spec.num_classes)
    variables, occ_params, source = load_variables(config, model, workdir=workdir,
                                                   checkpoint=checkpoint, step=step, ema=ema)
    ctx = build_context(config, model, variables, occ_params)
    out = out or os.path.join(workdir or os.path.dirname(os.path.abspath(checkpoint)), "eval")
    os.makedirs(out, exist_ok=True)
    results, figure_paths = {}, {}
    for name in names:
        start = time.time()
        print(f"== {name}", flush=True)
        try:
            result = available[name](ctx)
        except (runner.SuiteSkipped, sources.MissingDataError) as e:
            print(f"[{name}] skipped: {e}", flush=True)
            result = dict(skipped=str(e))
        figs = result.pop("figures", {})
        result["seconds"] = round(time.time() - start, 1)
        results[name] = result
        if jax.process_index() == 0:
            if "skipped" not in result:
                figure_paths[name] = figures.make(name, result, figs, os.path.join(out, "figures"))
            with open(os.path.join(out, f"{name}.json"), "w") as f:
                json.dump(result, f, indent=2)
        print(f"[{name}] done in {result['seconds']}s", flush=True)
    if jax.process_index() == 0:
        path = report.write(out, results, figure_paths, model_name=config.model_name,
                            dataset=config.dataset, source=source, config=config)
        print(f"Report: {path}", flush=True)
    return results
