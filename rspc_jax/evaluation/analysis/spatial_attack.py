"""spatial_attack (Bhojanapalli et al. Sec. 3.6, Fig. 3 right): accuracy over a grid of
translations and rotations; robust = correct at every grid point."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rspc_jax.evaluation import figures as plots
from rspc_jax.evaluation import loop as runner
from rspc_jax.evaluation import report
from rspc_jax.evaluation.analysis import spatial
from rspc_jax.evaluation.loop import Context

# The summary writes n/a where a number is missing.
_pct = functools.partial(report.pct, missing="n/a")


def _robust_on(correct: np.ndarray, points: np.ndarray):
    return float(correct[:, points].all(axis=1).mean()) if points.any() else None


def run(ctx: Context) -> dict:
    s = ctx.settings
    points = spatial.grid(s.max_translation, s.translations, s.max_rotation, s.rotations)
    mean, std = jnp.asarray(ctx.spec.mean), jnp.asarray(ctx.spec.std)

    def step(variables, batch, rng):
        pixels = batch["image"] * std + mean

        def correct_at(point):
            images = (spatial.transform(pixels, point) - mean) / std
            return runner.correct(ctx.logits(variables, images), batch["label"])

        return dict(correct=jax.lax.map(correct_at, jnp.asarray(points)).T)  # (B, G)

    out = runner.run_pass(
        ctx,
        runner.sharded(ctx, step),
        jax.random.PRNGKey(ctx.seed),
        label="spatial_attack",
        limit=s.spatial_examples,
    )
    correct = out["correct"]
    per_point = correct.mean(axis=0)
    identity = np.flatnonzero((points == 0).all(axis=1))
    angles = np.unique(points[:, 2])
    shifts = np.unique(points[:, 0])
    return dict(
        definitions=(
            "robust = correctly classified at every grid point (translation dy, dx in "
            "pixels, rotation in degrees about the centre, bilinear, black fill)"
        ),
        num_examples=int(correct.shape[0]),
        grid_points=int(len(points)),
        translations=[float(v) for v in shifts],
        rotations=[float(v) for v in angles],
        clean=float(per_point[identity[0]]) if identity.size else None,
        robust=float(correct.all(axis=1).mean()),
        # The two sub-grids through the identity (when the grid has it): which part hurts.
        robust_translations_only=_robust_on(correct, points[:, 2] == 0),
        robust_rotations_only=_robust_on(correct, (points[:, :2] == 0).all(axis=1)),
        worst_point=dict(
            accuracy=float(per_point.min()),
            point=[float(v) for v in points[int(per_point.argmin())]],
        ),
        accuracy_by_rotation=[float(per_point[points[:, 2] == a].mean()) for a in angles],
        figures=dict(points=points, per_point=per_point),
    )


def rows(r: dict) -> list[str]:
    worst = r["worst_point"]
    return [
        f"examples: {r['num_examples']}, grid points: {r['grid_points']}",
        f"clean (0 px, 0 deg): {_pct(r['clean'])}%",
        f"robust over the whole grid: {_pct(r['robust'])}% (translations only: "
        f"{_pct(r['robust_translations_only'])}%, rotations only: {_pct(r['robust_rotations_only'])}%)",
        f"worst single point {worst['point']}: {_pct(worst['accuracy'])}%",
    ]


def figures(result: dict, arrays: dict, out_dir: str) -> list[str]:
    points, per_point = arrays["points"], arrays["per_point"]
    shifts = np.asarray(result["translations"])
    grid = np.asarray(
        [
            [per_point[(points[:, 0] == dy) & (points[:, 1] == dx)].mean() for dx in shifts]
            for dy in shifts
        ]
    )
    fig, (left, right) = plots.plt.subplots(1, 2, figsize=(11, 4))
    half = (shifts[1] - shifts[0]) / 2 if len(shifts) > 1 else 0.5  # cells centred on the values
    extent = (shifts[0] - half, shifts[-1] + half) * 2
    image = left.imshow(100 * grid, origin="lower", extent=extent)
    left.set_xlabel("dx (px)")
    left.set_ylabel("dy (px)")
    left.set_title("accuracy (%), mean over rotations")
    fig.colorbar(image, ax=left, fraction=0.046)
    right.plot(result["rotations"], 100 * np.asarray(result["accuracy_by_rotation"]), marker=".")
    right.axhline(
        100 * result["robust"], color="r", linestyle="--", label="robust (all grid points)"
    )
    right.set_xlabel("rotation (degrees)")
    right.set_ylabel("accuracy (%)")
    right.set_title("mean over translations")
    right.legend(fontsize=8)
    return [plots.save(fig, out_dir, "spatial_attack.png")]
