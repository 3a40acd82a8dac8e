"""cifar100_c: accuracy on CIFAR-100-C's corruptions and severities, from the released .npy
files."""

from rspc_jax.evaluation import figures as plots
from rspc_jax.evaluation.loop import Context
from rspc_jax.evaluation.suites import shift_data

rows = shift_data.cifar_c_rows


def run(ctx: Context) -> dict:
    return shift_data.cifar_c(ctx, "cifar100_c", 100, "cifar100_c_dir", None)


def figures(result: dict, arrays: dict, out_dir: str) -> list[str]:
    return [plots.corruption_errors(result, out_dir, "cifar100_c")]
