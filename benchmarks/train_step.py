"""Speed of train-step variants of a config's model, measured in one run.

    python -m benchmarks.train_step --config=configs/demo.py --steps=30
    python -m benchmarks.train_step --config=configs/demo.py --variants=plain,rspc,fgsm_at,trades1

Every variant runs on the same random global batch in the same process (no input
pipeline), each blocked per step; the table gives compile time, median step time,
images/s (clean images per step / median), the step-time ratio to the first
variant, XLA's FLOP count of the step with the model FLOPs utilisation (on GPUs/TPUs),
XLA's memory estimate and the device's peak memory. Options that matter on accelerators:
`--config.compute_dtype=bfloat16`, `--config.remat=True`, `--config.scan_blocks=True`
(ViT/DeiT); the step donates its state. Variants: 'plain' (no RSPC), 'rspc', 'plain_2x'
(the plain step on twice the batch, as many images as RSPC's forward: rspc / plain_2x is
RSPC's cost beyond the doubled batch, plain_2x / plain the doubled batch's), or any name of
rspc_jax.training.ablations (the adversarial-training baselines of the paper's Fig. 7 among
them).

    python -m benchmarks.train_step --config=configs/deit_s.py --batch=8 --steps=5 --compare_timm

`--compare_timm` then times timm's train step of the same model in a fresh process
(benchmarks.timm_step), alternating with more of our steps for `--rounds` rounds, and
prints the median time ratio and both peak memories. `--compare_command` does the same with
any reference step, e.g. the official RVT code's (benchmarks/official_step.py):

    python -m benchmarks.train_step --config=configs/rvt_ti.py --config.patch_aug=off --batch=8 \
        --steps=5 --compare_command="plain=python benchmarks/official_step.py plain {steps}" \
        --compare_command="rspc=python benchmarks/official_step.py rspc {steps}"

`--interleave` alternates our variants alone in the same way and prints their medians over
all rounds against the first variant, with rspc / plain, rspc / plain_2x and plain_2x /
plain: ratios between our own steps that the machine's drift does not bias. A variant
followed by @CHOICE=VALUE is traced and compiled with that implementation choice of
rspc_jax.models.ops (`ops.CHOICES`), so one command is a same-process A/B of a backend
choice:

    python -m benchmarks.train_step --config=configs/rvt_ti.py --batch=8 --steps=3 --rounds=10 \
        --interleave --variants=rspc,rspc@batched_gradient=xla

`--compile_only` compiles each variant without running it and prints the compile times,
FLOPs and XLA's memory estimates; with JAX_COMPILATION_CACHE_DIR set it fills that cache,
so that several configs can compile at once on a many-core host before they are timed one
at a time (launch/benchmark_accelerator.sh). On CPU, with that cache on, the steps take
jaxlib's default products, which the cache stores, not oneDNN's (`ops.compiler_options`).

How large a micro-batch fits a TPU slice is `python -m rspc_jax.plan`, part of the library.
"""

import shlex

from absl import app, flags
from ml_collections import config_flags

from rspc_jax.tools import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=False)
_STEPS = flags.DEFINE_integer(
    "steps", 20, "Timed steps per variant (after compilation).", lower_bound=1
)
_BATCH = flags.DEFINE_integer("batch", 0, "Global batch size (0 = the config's).")
_VARIANTS = flags.DEFINE_string(
    "variants",
    "plain,rspc",
    "Comma-separated step variants: plain, rspc, plain_2x (plain on twice the batch) or names "
    "of rspc_jax.training.ablations, each optionally followed by @CHOICE=VALUE (an "
    "implementation choice of rspc_jax.models.ops, e.g. rspc@cpu_products=xla).",
)
_PROFILE_DIR = cli.DEFINE_path(
    "profile_dir",
    "",
    "Also trace 2 steps of each variant with jax.profiler into <dir>/<variant> and print "
    "its top ten ops (XLA thunks) by time with their HLO; with plain and rspc both, also the "
    "model layers where RSPC's step takes more than twice the plain step's op time.",
)
_COMPARE_TIMM = flags.DEFINE_bool(
    "compare_timm",
    False,
    "Also time timm's train step of the same model (ViT/DeiT, XCiT) in a subprocess and print "
    "the time and peak-memory ratios (needs requirements-torch.txt).",
)
_COMPARE_COMMAND = flags.DEFINE_multi_string(
    "compare_command",
    [],
    "VARIANT=COMMAND: a reference step for our variant VARIANT (e.g. the official PyTorch "
    "code's, for RVT and FAN), run in a fresh process each round; '{steps}' in COMMAND "
    "becomes --steps; its last printed line is a JSON record with 'times' (seconds per "
    "step) and optionally 'peak_rss_bytes', 'cores_busy' and 'framework'. Repeatable.",
)
_ROUNDS = flags.DEFINE_integer(
    "rounds",
    3,
    "With --compare_timm, --compare_command or --interleave: the steps alternate this many "
    "times (--steps each), so that the machine's drift does not bias the ratios.",
    lower_bound=1,
)
_INTERLEAVE = flags.DEFINE_bool(
    "interleave",
    False,
    "Also alternate our variants for --rounds rounds of --steps steps and print the medians "
    "over all rounds, each against the first variant: step-time ratios (rspc/plain) that the "
    "machine's drift over minutes does not bias. --compare_timm and --compare_command "
    "interleave anyway.",
)
_COMPILE_ONLY = flags.DEFINE_bool(
    "compile_only",
    False,
    "Only build each variant's step, running no step: print the compile times, FLOPs and "
    "XLA's memory estimate (and fill JAX's persistent compilation cache when "
    "JAX_COMPILATION_CACHE_DIR is set, so that a later timed run loads the compiled steps).",
)


def main(argv):
    cli.start(argv)
    from benchmarks import measure, side_by_side, tables, variants

    config = _CONFIG.value
    if config is None:
        raise app.UsageError("pass --config=configs/<file>.py[:variant]")
    if _BATCH.value:
        config.batch_size = _BATCH.value
    _refuse_unused_flags()
    names = _VARIANTS.value.split(",")
    variants.check_variants(names)
    if _COMPILE_ONLY.value:
        tables.print_compile_table(config, measure.compile_variants(config, names))
        return
    references = _references(config, side_by_side)
    interleaved = bool(references) or _INTERLEAVE.value
    results = measure.time_variants(
        config, names, _STEPS.value, profile_dir=_PROFILE_DIR.value, keep_timers=interleaved
    )
    tables.print_table(config, results, _STEPS.value)
    if interleaved:
        side_by_side.compare_side_by_side(results, references, _STEPS.value, _ROUNDS.value)


def _refuse_unused_flags() -> None:
    """--compile_only runs no step: the flags of timed runs would be ignored."""
    timed = [
        name
        for name, given in (
            ("--compare_timm", _COMPARE_TIMM.value),
            ("--compare_command", _COMPARE_COMMAND.value),
            ("--interleave", _INTERLEAVE.value),
            ("--profile_dir", _PROFILE_DIR.value),
        )
        if given
    ]
    if _COMPILE_ONLY.value and timed:
        raise app.UsageError(
            f"--compile_only runs no step, so {', '.join(timed)} would do nothing: drop "
            f"{'it' if len(timed) == 1 else 'them'}, or drop --compile_only to time the steps"
        )


def _references(config, side_by_side) -> dict:
    """variant -> (label, command) of the reference steps to alternate with ours."""
    references = {}
    if _COMPARE_TIMM.value:
        references["plain"] = ("timm", side_by_side.timm_command(config, _STEPS.value))
    for entry in _COMPARE_COMMAND.value:
        variant, _, command = entry.partition("=")
        if not command or variant not in _VARIANTS.value.split(","):
            raise app.UsageError(
                f"--compare_command={entry!r}: write VARIANT=COMMAND with VARIANT one of "
                f"--variants ({_VARIANTS.value}), e.g. plain='python time_official.py plain "
                "{steps}'"
            )
        if variant in references:
            raise app.UsageError(f"two reference steps for variant {variant!r}")
        label = f"ref:{variant}"
        references[variant] = (label, shlex.split(command.replace("{steps}", str(_STEPS.value))))
    return references


if __name__ == "__main__":
    cli.run(main)
