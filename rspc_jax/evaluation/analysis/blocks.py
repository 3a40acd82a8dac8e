"""What the analyses share: the blocks' intermediate outputs and their shapes, and the
accuracy under an intervention with one compiled step that every lesion or mask is fed to as
an argument (`models.interventions`)."""

import jax
import jax.numpy as jnp
import numpy as np

from rspc_jax import parallel
from rspc_jax.evaluation import loop as runner
from rspc_jax.evaluation.loop import Context
from rspc_jax.models import interventions


def intermediates(ctx: Context, variables, images, **kwargs) -> dict:
    _, state = ctx.model.apply(variables, images, train=False, mutable=["intermediates"], **kwargs)
    return state["intermediates"]


def block_shapes(ctx: Context) -> tuple[list, list]:
    """Shapes of the blocks' outputs (1, N, D) and attention maps (1, h, N, N)."""
    size = ctx.config.image_size
    image = jax.ShapeDtypeStruct((1, size, size, 3), jnp.float32)
    shapes = jax.eval_shape(
        lambda v, x: intermediates(ctx, v, x, sow_attention=True), ctx.variables, image
    )
    return (
        [s.shape for s in shapes["block_outputs"]],
        [s.shape for s in shapes.get("attention_maps", ())],
    )


def json_matrix(matrix: np.ndarray) -> list:
    return [[None if np.isnan(v) else round(float(v), 6) for v in row] for row in matrix]


def intervention_accuracy(ctx: Context, label: str):
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
