"""Runs the suites of a training run or a checkpoint file and writes the JSON files, the
report and the figures; the CLI is `rspc_jax.evaluate`."""

import json
import os
import time

from absl import logging
import jax

from rspc_jax import ConfigError, models, parallel, rspc
from rspc_jax.data import specs as datasets
from rspc_jax.evaluation import figures, report, sources
from rspc_jax.evaluation import loop as runner
from rspc_jax.evaluation import shift_suites as benchmarks
from rspc_jax.evaluation import suites as suites_lib
from rspc_jax.interop import checkpoints as checkpointing
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


def run_suites(
    config, *, workdir=None, checkpoint=None, step=None, ema=False, suites=None, out=None
) -> dict:
    """Runs the suites; returns {suite: result} and writes the files."""
    available = {**suites_lib.SUITES, **benchmarks.SUITES}
    names = [s for s in (suites or config.evaluation.suites).split(",") if s]
    unknown = sorted(set(names) - set(available))
    if unknown:
        raise ConfigError(f"unknown suites {unknown}; choose from {sorted(available)}")
    spec = datasets.dataset_spec(config.dataset)
    model = models.from_config(config, spec.num_classes)
    variables, corruption_params, source = load_variables(
        config, model, workdir=workdir, checkpoint=checkpoint, step=step, ema=ema
    )
    ctx = build_context(config, model, variables, corruption_params)
    out = out or os.path.join(workdir or os.path.dirname(os.path.abspath(checkpoint)), "eval")
    os.makedirs(out, exist_ok=True)
    results, figure_paths = {}, {}
    for name in names:
        start = time.time()
        logging.info(f"== {name}")
        try:
            result = available[name](ctx)
        except (runner.SuiteSkipped, sources.MissingDataError) as e:
            logging.info(f"[{name}] skipped: {e}")
            result = dict(skipped=str(e))
        figs = result.pop("figures", {})
        result["seconds"] = round(time.time() - start, 1)
        results[name] = result
        if jax.process_index() == 0:
            if "skipped" not in result:
                figure_paths[name] = figures.make(name, result, figs, os.path.join(out, "figures"))
            with open(os.path.join(out, f"{name}.json"), "w") as f:
                json.dump(result, f, indent=2)
        logging.info(f"[{name}] done in {result['seconds']}s")
    if jax.process_index() == 0:
        path = report.write(
            out,
            results,
            figure_paths,
            model_name=config.model_name,
            dataset=config.dataset,
            source=source,
            config=config,
        )
        logging.info(f"Report: {path}")
    return results
