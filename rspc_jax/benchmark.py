"""Speed of train-step variants of a config's model, measured in one run.

    python -m rspc_jax.benchmark --config=configs/demo.py --steps=30
    python -m rspc_jax.benchmark --config=configs/demo.py --variants=plain,rspc,fgsm_at,trades1,trades2,trades3

Every variant runs on the same random global batch in the same process (no input
pipeline), each blocked per step; the table gives compile time, median step time,
images/s (clean images per step / median), the step-time ratio to the first
variant, XLA's FLOP count of the step with the model FLOPs utilisation (on GPUs/TPUs),
XLA's memory estimate and the device's peak memory. Options that matter on accelerators:
`--config.compute_dtype=bfloat16`, `--config.remat=True`, `--config.scan_blocks=True`
(ViT/DeiT); the step donates its state. Variants: 'plain' (no RSPC), 'rspc', or any name
of rspc_jax.training.ablations (the adversarial-training baselines of the paper's Fig. 7 among them).

    python -m rspc_jax.benchmark --config=configs/deit_s.py --batch=8 --steps=5 --compare_timm

`--compare_timm` then times timm's train step of the same model in a fresh process
(rspc_jax.tools.timm_step) and prints our steps' time ratio to it and both peak memories.
"""

from absl import app, flags
from ml_collections import config_flags

from rspc_jax.tools import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=False)
_STEPS = flags.DEFINE_integer("steps", 20, "Timed steps per variant (after compilation).")
_BATCH = flags.DEFINE_integer("batch", 0, "Global batch size (0 = the config's).")
_VARIANTS = flags.DEFINE_string(
    "variants",
    "plain,rspc",
    "Comma-separated step variants: plain, rspc or names of rspc_jax.training.ablations.",
)
_PROFILE_DIR = flags.DEFINE_string(
    "profile_dir",
    "",
    "Also trace 2 steps of each variant with jax.profiler into <dir>/<variant> and print "
    "its top ten ops (XLA thunks) by time with their HLO.",
)
_COMPARE_TIMM = flags.DEFINE_bool(
    "compare_timm",
    False,
    "Also time timm's train step of the same model (ViT/DeiT, XCiT) in a subprocess and print "
    "the time and peak-memory ratios (needs requirements-torch.txt).",
)


def main(argv):
    cli.start(argv)
    from rspc_jax.tools import benchmark

    config = _CONFIG.value
    if config is None:
        raise app.UsageError("pass --config=configs/<file>.py[:variant]")
    if _BATCH.value:
        config.batch_size = _BATCH.value
    results = benchmark.print_table(
        config, _VARIANTS.value.split(","), _STEPS.value, profile_dir=_PROFILE_DIR.value
    )
    if _COMPARE_TIMM.value:
        benchmark.compare_with_timm(config, results, _STEPS.value)


if __name__ == "__main__":
    cli.run(main)
