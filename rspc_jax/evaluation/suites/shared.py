"""What several suites share: the distribution summary of a per-image or per-mask number,
the first eval images for the figures and the kind of attention a model sows."""

import jax
import numpy as np

from rspc_jax.data import eval as data
from rspc_jax.evaluation.loop import Context


def distribution(values: np.ndarray) -> dict:
    """Mean, standard deviation and five-number summary of `values`."""
    q1, median, q3 = np.percentile(values, [25, 50, 75])
    return dict(
        mean=float(values.mean()),
        std=float(values.std()),
        min=float(values.min()),
        q1=float(q1),
        median=float(median),
        q3=float(q3),
        max=float(values.max()),
    )


def first_batch(ctx: Context, count: int):
    """The first `count` eval images (normalised, this host) and labels, for the figures."""
    examples, _ = ctx.examples()
    size = ctx.config.image_size
    batch = next(
        data.host_batches(
            examples,
            local_batch=count,
            batches=1,
            image_shape=(size, size, 3),
            mean=ctx.spec.mean,
            std=ctx.spec.std,
        )
    )
    return batch["image"][batch["mask"] > 0], batch["label"][batch["mask"] > 0]


def to_pixels(ctx: Context, images) -> np.ndarray:
    """Normalised images back to [0, 1] pixels for plotting."""
    return np.clip(np.asarray(images) * np.asarray(ctx.spec.std) + np.asarray(ctx.spec.mean), 0, 1)


def attention_kind(model) -> str:
    """What the sown attention maps attend over: 'tokens' (N x N, what the query-patch figures
    and Patch-Fool need), 'channels' (XCiT's d x d maps) or 'windows' (Swin's maps inside each
    local window)."""
    return {"XCiT": "channels", "Swin": "windows"}.get(type(model).__name__, "tokens")


def attention_layers(ctx: Context) -> int:
    """How many attention maps the model sows for one image (shapes only, nothing runs)."""
    size = ctx.config.image_size
    image = jax.ShapeDtypeStruct((1, size, size, 3), np.float32)
    return len(jax.eval_shape(ctx.logits_and_attention, ctx.variables, image)[1])
