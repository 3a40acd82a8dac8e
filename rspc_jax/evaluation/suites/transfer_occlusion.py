"""transfer_occlusion: accuracy under the masks of another run's corruption model, a fixed
and independently trained C (`evaluation.transfer_from`: the workdir of that run), applied
to the evaluated model. A transfer attack: every method of a study meets the same adversary,
where patch_occlusion's "trained corruption model's mask" is each run's own C (a different
adversary per method, and none for plain training). The noise is patch_occlusion's (the same
key), so a run evaluated with its own workdir as the source reproduces its own C's number."""

import json
import os

import jax
import ml_collections
import numpy as np
import tensorflow as tf

from rspc_jax import ConfigError, parallel, resolve_path
from rspc_jax.evaluation import report
from rspc_jax.evaluation.loop import Context, SuiteSkipped, run_pass, sharded
from rspc_jax.evaluation.suites import patch_occlusion
from rspc_jax.interop import checkpoints


def _source_config(workdir: str):
    path = os.path.join(workdir, "config.json")
    if not tf.io.gfile.exists(path):
        raise ConfigError(
            f"evaluation.transfer_from={workdir} has no config.json, so it is not a training "
            "run; name the workdir of a finished run trained with a corruption model "
            "(rspc on, learned selection)."
        )
    with tf.io.gfile.GFile(path) as f:
        return ml_collections.ConfigDict(json.load(f))


def _mismatches(ctx: Context, source) -> list[str]:
    """What the source's masks need of the evaluated run: the same images (size and
    normalisation, i.e. the dataset) and the same patch grid."""
    wanted = dict(
        image_size=(source.image_size, ctx.config.image_size),
        dataset=(source.dataset, ctx.config.dataset),
        patch=(source.rspc.patch_size or source.model.patch_size, ctx.patch_size),
    )
    return [
        f"{k} {theirs} (evaluated run: {ours})"
        for k, (theirs, ours) in wanted.items()
        if theirs != ours
    ]


def load_source(ctx: Context) -> tuple:
    """(the source run's config, its C's parameters), checked before anything compiles."""
    if not ctx.settings.transfer_from:
        raise SuiteSkipped(
            "no source of masks: set evaluation.transfer_from to the workdir of a run trained "
            "with a corruption model"
        )
    workdir = resolve_path(ctx.settings.transfer_from)
    source = _source_config(workdir)
    if not source.rspc.enabled or source.rspc.selection != "learned":
        raise ConfigError(
            f"evaluation.transfer_from={workdir} trained no corruption model (rspc off or "
            "random selection); name a run with learned selection."
        )
    mismatches = _mismatches(ctx, source)
    if mismatches:
        raise ConfigError(
            f"evaluation.transfer_from={workdir} was trained on other images or patches: "
            f"{'; '.join(mismatches)}. Its C's masks only fit runs of the same dataset, image "
            "size and patch grid; train the source on this run's setting."
        )
    _, state, _ = checkpoints.read_saved_state(os.path.join(workdir, "checkpoints"))
    return source, state["corruption_params"]


def _step(ctx: Context, source):
    rho, patch = ctx.settings.occlusion_rho, ctx.patch_size

    def step(variables, batch, rng):
        keep = patch_occlusion.chosen_keep(
            source.rspc, patch, variables["source"], batch["image"], rho, ctx.seed
        )
        correct = patch_occlusion.correct_under(ctx, variables["model"], batch, keep, rng)
        return dict(correct=correct, occluded=(keep == 0).astype("int8"))

    return step


def run(ctx: Context) -> dict:
    if ctx.occluded_count() == 0:
        raise ConfigError("transfer_occlusion needs evaluation.occlusion_rho > 0.")
    source, params = load_source(ctx)
    variables = dict(
        model=ctx.variables, source=jax.device_put(params, parallel.replicated(ctx.mesh))
    )
    out = run_pass(
        ctx,
        sharded(ctx, _step(ctx, source)),
        patch_occlusion.noise_key(ctx),
        label="transfer_occlusion",
        variables=variables,
    )
    return dict(
        accuracy=float(out["correct"].mean()),
        source=resolve_path(ctx.settings.transfer_from),
        source_corruption_model=source.rspc.corruption_model,
        occluded_patches=ctx.occluded_count(),
        num_patches=ctx.num_patches(),
        distinct_masks=int(len(np.unique(out["occluded"], axis=0))),
        num_examples=int(out["correct"].size),
    )


def rows(result: dict) -> list[tuple[str, str]]:
    return [
        ("the source C's masks (%)", report.pct(result["accuracy"])),
        ("source run", result["source"]),
        ("source's corruption model", result["source_corruption_model"]),
        ("occluded patches", f"{result['occluded_patches']} of {result['num_patches']}"),
        ("distinct masks", f"{result['distinct_masks']} of {result['num_examples']}"),
    ]
