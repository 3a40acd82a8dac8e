"""corrupted_local: ImageNet-C-style corruptions generated on the fly (imagecorruptions) on
the run's own eval images; not the released files, so not comparable with published
numbers."""

import jax
import numpy as np

from rspc_jax.evaluation import figures as plots
from rspc_jax.evaluation import loop as runner
from rspc_jax.evaluation import protocols, report
from rspc_jax.evaluation.loop import Context, SuiteSkipped, run_pass


def _corrupter(name: str, severity: int, seed: int):
    """transform(uint8 images, labels) with imagecorruptions' global NumPy RNG seeded once
    per (corruption, severity, host), so a rerun gives the same images."""
    from imagecorruptions import corrupt

    np.random.seed(seed)

    def transform(images, labels):
        return np.stack(
            [corrupt(image, severity=severity, corruption_name=name) for image in images]
        )

    return transform


def run(ctx: Context) -> dict:
    if ctx.config.image_size < 32:
        raise SuiteSkipped("imagecorruptions needs images of at least 32x32 pixels")
    names = protocols.corruption_names(ctx.settings.corruptions)
    step = runner.accuracy_step(ctx)
    accuracy = {}
    for c, name in enumerate(names):
        for severity in ctx.settings.severities:
            seed = (ctx.seed * 1000 + c * 10 + severity) * 1000 + jax.process_index()
            out = run_pass(
                ctx,
                step,
                jax.random.PRNGKey(0),
                label=f"{name} s{severity}",
                transform=_corrupter(name, severity, seed),
            )
            accuracy[f"{name}/{severity}"] = float(out["correct"].mean())
    per_corruption = {
        name: float(np.mean([accuracy[f"{name}/{s}"] for s in ctx.settings.severities]))
        for name in names
    }
    no_noise = [v for k, v in per_corruption.items() if k not in protocols.NOISE_CORRUPTIONS]
    return dict(
        note=(
            "corruptions generated on the fly with imagecorruptions-imaug on the "
            f"{ctx.config.dataset} eval images after their eval preprocessing; NOT the "
            "released ImageNet-C/CIFAR-C files, so not comparable with published numbers"
        ),
        accuracy=accuracy,
        per_corruption=per_corruption,
        mean_accuracy=float(np.mean(list(per_corruption.values()))),
        mean_accuracy_no_noise=float(np.mean(no_noise)) if no_noise else None,
        corruptions=list(names),
        severities=list(ctx.settings.severities),
    )


def rows(result: dict) -> list[tuple[str, str]]:
    per_corruption = [
        (f"{c} (%, mean over severities)", report.pct(a))
        for c, a in result["per_corruption"].items()
    ]
    return per_corruption + [
        ("mean accuracy (%)", report.pct(result["mean_accuracy"])),
        ("mean accuracy w/o noise (%)", report.pct(result["mean_accuracy_no_noise"])),
    ]


def figures(result: dict, arrays: dict, out_dir: str) -> list[str]:
    return [plots.corruption_errors(result, out_dir, "corrupted_local")]
