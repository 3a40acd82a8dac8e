"""Runs the analyses on a training run or a checkpoint and writes <out>/<name>.json,
<out>/summary.md and <out>/figures/*.png; the CLI is `rspc_jax.analyze`."""

import json
import os
import time

from absl import logging
import jax

from rspc_jax import models
from rspc_jax.data import specs as datasets
from rspc_jax.evaluation import loop as runner
from rspc_jax.evaluation import run_suites as evaluation_run
from rspc_jax.evaluation.analysis import analyses as analyses_lib
from rspc_jax.evaluation.analysis import figures, tables


def run_analyses(
    config, *, analyses: str, workdir=None, checkpoint=None, step=None, ema=False, out=None
) -> dict:
    """Runs the comma-separated `analyses`; returns {name: result} and writes the files."""
    names = [name for name in analyses.split(",") if name]
    unknown = sorted(set(names) - set(analyses_lib.ANALYSES))
    if unknown or not names:
        raise ValueError(
            f"unknown analyses {unknown or names}; choose from "
            f"{sorted(analyses_lib.ANALYSES)} (comma-separated)"
        )
    spec = datasets.dataset_spec(config.dataset)
    model = models.from_config(config, spec.num_classes)
    variables, _, source = evaluation_run.load_variables(
        config, model, workdir=workdir, checkpoint=checkpoint, step=step, ema=ema
    )
    ctx = evaluation_run.build_context(config, model, variables, settings=config.analysis)
    out = out or os.path.join(workdir or os.path.dirname(os.path.abspath(checkpoint)), "analysis")
    os.makedirs(out, exist_ok=True)
    results, summary = {}, [f"# Analyses of {config.model_name} ({source}) on {config.dataset}", ""]
    for name in names:
        start = time.time()
        logging.info(f"== {name}")
        try:
            result = analyses_lib.ANALYSES[name](ctx)
        except runner.SuiteSkipped as e:
            logging.info(f"[{name}] skipped: {e}")
            result = dict(skipped=str(e))
        figs = result.pop("figures", None)
        result["seconds"] = round(time.time() - start, 1)
        results[name] = result
        lines = [f"skipped: {result['skipped']}"] if figs is None else tables.TABLES[name](result)
        print("\n".join(lines), flush=True)
        summary += [f"## {name} ({result['seconds']} s)", "", *lines, ""]
        if jax.process_index() == 0:
            if figs is not None:
                for path in figures.FIGURES[name](result, figs, os.path.join(out, "figures")):
                    summary += [f"![{name}]({os.path.relpath(path, out)})", ""]
            with open(os.path.join(out, f"{name}.json"), "w") as f:
                json.dump(result, f, indent=2)
    if jax.process_index() == 0:
        with open(os.path.join(out, "summary.md"), "w") as f:
            f.write("\n".join(summary))
        logging.info(f"Summary: {os.path.join(out, 'summary.md')}")
    return results
