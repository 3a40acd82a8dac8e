"""clean: top-1/top-5 accuracy and cross-entropy on the eval split, optionally the FGSM
accuracy. Training's periodic evaluation is this suite."""

import jax
import jax.numpy as jnp

from rspc_jax import rspc
from rspc_jax.evaluation import attacks, report
from rspc_jax.evaluation import loop as runner
from rspc_jax.evaluation.loop import Context, run_pass, sharded


def run(ctx: Context, fgsm_eps: float = 0.0) -> dict:
    """Top-1/top-5 accuracy and cross-entropy on the eval split; with `fgsm_eps` > 0 also
    the FGSM accuracy (pixels in [0, 1], no random start: the thesis's early-stopping
    metric)."""
    mean, std = jnp.asarray(ctx.spec.mean), jnp.asarray(ctx.spec.std)

    def step(variables, batch, rng):
        logits = ctx.logits(variables, batch["image"]).astype(jnp.float32)
        labels = batch["label"]
        out = dict(
            top1=runner.correct(logits, labels),
            top5=runner.correct(logits, labels, min(5, logits.shape[-1])),
            ce=rspc.per_example_cross_entropy(logits, labels),
        )
        if fgsm_eps > 0:
            logits_fn = lambda pixels: ctx.logits(variables, (pixels - mean) / std)  # noqa: E731
            adv = attacks.fgsm(logits_fn, batch["image"] * std + mean, labels, eps=fgsm_eps)
            out["fgsm"] = runner.correct(logits_fn(adv), labels)
        return out

    out = run_pass(
        ctx,
        sharded(ctx, step, name=f"clean_fgsm{fgsm_eps}"),
        jax.random.PRNGKey(ctx.seed),
        label="clean",
    )
    result = dict(
        top1=float(out["top1"].mean()),
        top5=float(out["top5"].mean()),
        loss=float(out["ce"].mean()),
        num_examples=int(out["top1"].size),
    )
    if fgsm_eps > 0:
        result["fgsm_accuracy"] = float(out["fgsm"].mean())
    return result


def rows(result: dict) -> list[tuple[str, str]]:
    return [
        ("top-1 (%)", report.pct(result["top1"])),
        ("top-5 (%)", report.pct(result["top5"])),
        ("examples", str(result["num_examples"])),
    ]
