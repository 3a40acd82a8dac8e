"""The analyses of Bhojanapalli et al. Sec. 3.6 and 4. Each takes a `runner.Context` whose
settings are config.analysis and returns a JSON-serialisable dict (arrays for the figures
under 'figures'). Lesions and masks go through `interventions`, so each analysis compiles
one step and feeds it every lesion or mask as an argument."""

import jax
import jax.numpy as jnp
import numpy as np

from rspc_jax import parallel
from rspc_jax.evaluation import loop as runner
from rspc_jax.evaluation.analysis import attention_masks, similarity, spatial
from rspc_jax.evaluation.loop import Context, SuiteSkipped
from rspc_jax.models import interventions, xcit


def _intermediates(ctx: Context, variables, images, **kwargs) -> dict:
    _, state = ctx.model.apply(variables, images, train=False, mutable=["intermediates"], **kwargs)
    return state["intermediates"]


def block_shapes(ctx: Context) -> tuple[list, list]:
    """Shapes of the blocks' outputs (1, N, D) and attention maps (1, h, N, N)."""
    size = ctx.config.image_size
    image = jax.ShapeDtypeStruct((1, size, size, 3), jnp.float32)
    shapes = jax.eval_shape(
        lambda v, x: _intermediates(ctx, v, x, sow_attention=True), ctx.variables, image
    )
    return (
        [s.shape for s in shapes["block_outputs"]],
        [s.shape for s in shapes.get("attention_maps", ())],
    )


def _json_matrix(matrix: np.ndarray) -> list:
    return [[None if np.isnan(v) else round(float(v), 6) for v in row] for row in matrix]


def _intervention_accuracy(ctx: Context, label: str):
    """accuracy(intervention) over the eval examples, with one compiled step."""

    def step(variables_and_intervention, batch, rng):
        variables, intervention = variables_and_intervention
        logits = interventions.apply(
            ctx.model, variables, batch["image"], intervention, train=False
        )
        return dict(correct=runner.correct(logits, batch["label"]))

    sharded_step = runner.sharded(ctx, step)
    replicated = parallel.replicated(ctx.mesh)

    def accuracy(intervention: interventions.Intervention, name: str) -> float:
        arguments = jax.device_put((ctx.variables, intervention), replicated)
        out = runner.run_pass(
            ctx,
            sharded_step,
            jax.random.PRNGKey(ctx.seed),
            label=f"{label} {name}",
            variables=arguments,
        )
        return float(out["correct"].mean())

    return accuracy


# --------------------------------------------------------------------------------------
# layer_correlation (Fig. 7)


def layer_correlation(ctx: Context) -> dict:
    prefix = interventions.num_prefix_tokens(ctx.model)

    def step(variables, batch):
        outputs = _intermediates(ctx, variables, batch["image"])["block_outputs"]
        mask = batch["mask"]
        all_tokens = [o.reshape(o.shape[0], -1) for o in outputs]
        summary = [o[:, 0] if prefix else o.mean(axis=1) for o in outputs]
        return dict(
            pearson_all=similarity.pearson_sums(all_tokens, mask),
            pearson_summary=similarity.pearson_sums(summary, mask),
            hsic_all=similarity.hsic_sums(all_tokens, mask),
            hsic_summary=similarity.hsic_sums(summary, mask),
            examples=mask.sum(),
        )

    sums = runner.sum_pass(ctx, runner.sharded_sum(ctx, step), label="layer_correlation")
    examples = float(sums["examples"])
    matrices = dict(
        pearson_all=sums["pearson_all"] / examples,
        pearson_summary=sums["pearson_summary"] / examples,
        cka_all=similarity.cka_from_hsic(sums["hsic_all"]),
        cka_summary=similarity.cka_from_hsic(sums["hsic_summary"]),
    )
    summary_token = "class token" if prefix else "mean of the tokens (the model has no class token)"
    return dict(
        definitions=dict(
            pearson=(
                "Pearson correlation of two blocks' flattened outputs, per example, averaged "
                "over examples (our reading of Bhojanapalli et al. Fig. 7; the paper does not "
                "define its statistic); null where the blocks' outputs differ in size"
            ),
            cka="linear CKA over examples, minibatch estimate with the unbiased HSIC (an extra)",
            all="all tokens of the block output",
            summary=summary_token,
        ),
        num_examples=int(examples),
        **{k: _json_matrix(v) for k, v in matrices.items()},
        figures=dict(matrices=matrices, summary_token=summary_token),
    )


# --------------------------------------------------------------------------------------
# lesion (Fig. 8)


def lesion(ctx: Context) -> dict:
    num_blocks = len(block_shapes(ctx)[0])
    branches = interventions.branch_names(ctx.model)
    accuracy = _intervention_accuracy(ctx, "lesion")

    def removed(blocks, branch_names=interventions.BRANCHES) -> interventions.Intervention:
        keep = interventions.keep_all(num_blocks)
        for branch in branch_names:
            keep[np.asarray(blocks, int), interventions.BRANCHES.index(branch)] = 0.0
        return interventions.Intervention(keep=keep)

    intact = accuracy(removed([]), "none")
    single = {
        what: [
            accuracy(removed([i], branches if what == "block" else (what,)), f"{what} {i}")
            for i in range(num_blocks)
        ]
        for what in ("block",) + branches
    }
    rng = np.random.default_rng(ctx.seed)
    samples = ctx.settings.lesion_samples
    multiple = {}
    for n in range(2, num_blocks):  # the first block always stays
        accuracies = np.asarray(
            [
                accuracy(
                    removed(rng.choice(np.arange(1, num_blocks), n, replace=False)),
                    f"{n} random blocks",
                )
                for _ in range(samples)
            ]
        )
        multiple[str(n)] = dict(
            mean=float(accuracies.mean()),
            standard_error=float(accuracies.std(ddof=1) / np.sqrt(samples)) if samples > 1 else 0.0,
            min=float(accuracies.min()),
            max=float(accuracies.max()),
            samples=[float(a) for a in accuracies],
        )
    return dict(
        definitions=(
            "a removed block, attention or MLP has its residual branch set to zero at "
            "inference (x + f(x) -> x); n random blocks: drawn from all but the first "
            f"block, {samples} independent samples per n"
        ),
        num_blocks=num_blocks,
        intact=intact,
        single=single,
        random_blocks=multiple,
        figures={},
    )


# --------------------------------------------------------------------------------------
# restricted_attention (Fig. 9)


def restricted_attention(ctx: Context) -> dict:
    if isinstance(ctx.model, xcit.XCiT):
        raise SuiteSkipped(
            "XCiT's self-attention (XCA) attends between channels, not patches, so "
            "restricting attention between patches does not apply"
        )
    prefix = interventions.num_prefix_tokens(ctx.model)
    tokens = [shape[-1] for shape in block_shapes(ctx)[1]]
    sides = [attention_masks.grid_side(n, prefix) for n in tokens]
    s = ctx.settings
    accuracy = _intervention_accuracy(ctx, "restricted_attention")

    def masked(allowed_per_block) -> interventions.Intervention:
        return interventions.Intervention(
            attention_bias=tuple(attention_masks.bias(a) for a in allowed_per_block)
        )

    def unrestricted(side):
        return attention_masks.local(side, prefix, radius=2 * side)

    radii = list(s.radii) or list(range(max(sides)))
    result = dict(
        unrestricted=accuracy(masked([unrestricted(k) for k in sides]), "none"),
        radii=radii,
        local=[],
        random=[],
        masked_fraction=[],
    )
    patch_pairs = (sides[0] ** 2) ** 2
    for radius in radii:
        local = [attention_masks.local(side, prefix, radius) for side in sides]
        random = [attention_masks.random_like(a, prefix, s.random_mask_seed) for a in local]
        result["local"].append(accuracy(masked(local), f"radius {radius}"))
        result["random"].append(accuracy(masked(random), f"random, radius {radius}"))
        result["masked_fraction"].append(
            attention_masks.masked_pairs(local[0], prefix) / patch_pairs
        )
    num_blocks = len(sides)
    counts = list(s.cls_only_blocks) or list(range(1, num_blocks + 1))
    cut = [attention_masks.no_patch_to_patch(side, prefix) for side in sides]
    full = [unrestricted(side) for side in sides]
    result["no_patch_attention"] = dict(
        blocks=counts,
        first=[accuracy(masked(cut[:k] + full[k:]), f"first {k} blocks") for k in counts],
        last=[
            accuracy(masked(full[: num_blocks - k] + cut[num_blocks - k :]), f"last {k} blocks")
            for k in counts
        ],
    )
    result["definitions"] = dict(
        local=(
            "patches attend only to patches within Chebyshev distance <= radius on the "
            "block's patch grid; class tokens attend to and from every token"
        ),
        random=(
            "the same number of masked patch pairs at places given by a fixed random "
            f"permutation (seed {s.random_mask_seed}) of the off-diagonal patch pairs"
        ),
        no_patch_attention=(
            "no attention between patches in the first / last k blocks: "
            + (
                "patches attend to the class token only"
                if prefix
                else "the model has no class token, so each patch attends to itself only"
            )
        ),
        masked_fraction="masked patch pairs / all patch pairs of the first block's grid",
    )
    result["figures"] = {}
    return result


# --------------------------------------------------------------------------------------
# spatial_attack (Sec. 3.6, Fig. 3 right)


def _robust_on(correct: np.ndarray, points: np.ndarray):
    return float(correct[:, points].all(axis=1).mean()) if points.any() else None


def spatial_attack(ctx: Context) -> dict:
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


ANALYSES = dict(
    layer_correlation=layer_correlation,
    lesion=lesion,
    restricted_attention=restricted_attention,
    spatial_attack=spatial_attack,
)
