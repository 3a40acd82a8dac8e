"""imagenet_r: top-1 on ImageNet-R with the logits restricted to its 200 classes."""

from rspc_jax.evaluation import protocols
from rspc_jax.evaluation.loop import Context
from rspc_jax.evaluation.suites import shift_data

rows = shift_data.subset_rows


def run(ctx: Context) -> dict:
    return shift_data.imagenet_subset(
        ctx,
        "imagenet_r",
        protocols.IMAGENET_R_WNIDS,
        protocols.IMAGENET_R_INDICES,
        "imagenet_r",
        "imagenet_r_dir",
        "hendrycks/imagenet-r",
    )
