"""adaptive_occlusion: accuracy under masks chosen per image against the evaluated model, by
a greedy search (evaluation/occlusion.py `greedy_keep`) with a stated budget of k * N + k
forward passes per image for k of N patches. It is the adaptive attack where the exact worst
case over every mask (patch_occlusion's `every_mask_accuracy`, at most
`occlusion_every_mask_limit` masks) is out of reach: 4 of 36 patches have 58905 masks.
Greedy masks can only be weaker than the worst case, so their accuracy bounds it from above.
The search is incremental, so the accuracy after each round (1, 2, ..., k patches) comes
with it: where k patches leave no image, fewer still tell methods apart. Each image keeps the
noise patch_occlusion draws for its every-mask pass (the same key), so that on few tokens
the two are compared mask for mask (for one patch they are the same search)."""

import jax
import numpy as np

from rspc_jax import ConfigError
from rspc_jax.evaluation import attacks, occlusion, report
from rspc_jax.evaluation import loop as runner
from rspc_jax.evaluation.loop import Context, run_pass, sharded
from rspc_jax.evaluation.suites import patch_occlusion


def _step(ctx: Context):
    occluded = ctx.occluded_count()

    def step(variables, batch, rng):
        images, labels = batch["image"], batch["label"]

        def logits_under(keep):
            return ctx.logits(variables, ctx.occlude(images, keep, rng))

        def margin_of(keep):
            return attacks.logit_margin(logits_under(keep), labels)

        rounds = occlusion.greedy_keep(margin_of, images.shape[0], ctx.num_patches(), occluded)
        correct = jax.lax.map(lambda keep: runner.correct(logits_under(keep), labels), rounds)
        return dict(correct=correct.T, occluded=(rounds[-1] == 0).astype("int8"))

    return step


def run(ctx: Context) -> dict:
    occluded, patches = ctx.occluded_count(), ctx.num_patches()
    if occluded == 0:
        raise ConfigError(
            "adaptive_occlusion needs evaluation.occlusion_rho > 0 (the patches it occludes); "
            "set it, or drop the suite from evaluation.suites."
        )
    out = run_pass(
        ctx, sharded(ctx, _step(ctx)), patch_occlusion.noise_key(ctx), label="adaptive_occlusion"
    )
    per_round = out["correct"].mean(axis=0)
    return dict(
        accuracy=float(per_round[-1]),
        accuracy_by_patches=[float(a) for a in per_round],
        search="greedy",
        occluded_patches=occluded,
        num_patches=patches,
        evaluations_per_image=occluded * patches + occluded,
        distinct_masks=int(len(np.unique(out["occluded"], axis=0))),
        num_examples=int(out["correct"].shape[0]),
    )


def rows(result: dict) -> list[tuple[str, str]]:
    return [
        ("greedy adaptive masks (%)", report.pct(result["accuracy"])),
        (
            "after 1, 2, ... patches (%)",
            " / ".join(report.pct(a) for a in result["accuracy_by_patches"]),
        ),
        ("occluded patches", f"{result['occluded_patches']} of {result['num_patches']}"),
        ("forward passes per image", str(result["evaluations_per_image"])),
        ("distinct masks found", f"{result['distinct_masks']} of {result['num_examples']}"),
    ]
