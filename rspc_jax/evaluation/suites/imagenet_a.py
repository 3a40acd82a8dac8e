"""imagenet_a: top-1 on ImageNet-A with the logits restricted to its 200 classes."""

from rspc_jax.evaluation import protocols
from rspc_jax.evaluation.loop import Context
from rspc_jax.evaluation.suites import shift_data

rows = shift_data.subset_rows


def run(ctx: Context) -> dict:
    return shift_data.imagenet_subset(
        ctx,
        "imagenet_a",
        protocols.IMAGENET_A_WNIDS,
        protocols.IMAGENET_A_INDICES,
        "imagenet_a",
        "imagenet_a_dir",
        "hendrycks/natural-adv-examples",
    )
