"""cifar10_c: accuracy on CIFAR-10-C's corruptions and severities, from the released .npy
files or tfds cifar10_corrupted."""

from rspc_jax.evaluation import figures as plots
from rspc_jax.evaluation.loop import Context
from rspc_jax.evaluation.suites import shift_data

rows = shift_data.cifar_c_rows


def run(ctx: Context) -> dict:
    return shift_data.cifar_c(ctx, "cifar10_c", 10, "cifar10_c_dir", "cifar10_corrupted")


def figures(result: dict, arrays: dict, out_dir: str) -> list[str]:
    return [plots.corruption_errors(result, out_dir, "cifar10_c")]
