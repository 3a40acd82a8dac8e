"""What `python -m rspc_jax.plan --preflight=SLICE` prints: the config's train and evaluation steps
compiled by the TPU compiler for one slice, fits / does not fit per chip, and the memory
check's fixes for a step that does not fit."""

from rspc_jax import ReportedError
from rspc_jax.tools import tpu_compile
from rspc_jax.training import memory_check, setup

GiB = tpu_compile.GiB


def run(config, name: str, tpu: tpu_compile.TpuSlice, headroom: float) -> bool:
    """Checks the config against the slice before compiling, compiles both steps, prints
    the verdicts; whether both fit."""
    setup.validate_config(config)
    for what, size in (
        ("batch_size", config.batch_size),
        ("eval_batch_size", config.eval_batch_size),
    ):
        if size % tpu.chips:
            raise ReportedError(
                f"config.{what}={size} does not split over the {tpu.chips} chips of {name}: "
                f"pass a multiple of {tpu.chips} (--config.{what}=...)"
            )
    per_chip = config.batch_size // tpu.chips
    print(
        f"{name}: {tpu.chips} chips on {tpu.hosts} host{'s' if tpu.hosts > 1 else ''}, "
        f"{tpu.hbm / GiB:.0f} GiB HBM each, budget {headroom:g} of it; {config.model_name}, "
        f"{config.image_size} px, compute_dtype {config.compute_dtype}, sharding "
        f"{config.sharding}, remat {config.remat}, RSPC {'on' if config.rspc.enabled else 'off'}"
    )
    train = tpu_compile.train_step(config, name, per_chip, headroom)
    print(
        _line(
            "train step",
            train,
            tpu,
            headroom,
            f"{per_chip} images per chip in {config.grad_accum_steps} micro-batch(es)",
        )
    )
    evaluation = tpu_compile.eval_step(config, name, config.eval_batch_size // tpu.chips, headroom)
    print(
        _line(
            "eval step",
            evaluation,
            tpu,
            headroom,
            f"{config.eval_batch_size // tpu.chips} images per chip",
        )
    )
    if not train.fits:
        print(_fixes(config, train, tpu, headroom))
    return train.fits and evaluation.fits


def _line(label: str, result: tpu_compile.Compiled, tpu, headroom: float, batch: str) -> str:
    verdict = "fits" if result.fits else "DOES NOT FIT"
    detail = ""
    if result.analysis is not None:
        a = result.analysis
        detail = (
            f" (arguments {a.argument_size_in_bytes / GiB:.2f}, outputs "
            f"{a.output_size_in_bytes / GiB:.2f}, temporaries {a.temp_size_in_bytes / GiB:.2f},"
            f" donated {a.alias_size_in_bytes / GiB:.2f})"
        )
    if result.refusal:
        detail = f"; the TPU compiler refused it: {result.refusal[:300]}"
    return (
        f"{label}: {verdict}, {batch}: {result.bytes / GiB:.2f} GiB per chip{detail} against "
        f"{headroom * tpu.hbm / GiB:.2f} GiB; TPU compiler, {result.seconds:.0f} s"
    )


def _fixes(config, result: tpu_compile.Compiled, tpu, headroom: float) -> str:
    analysis = result.analysis
    found = memory_check.Footprint(
        estimate=result.bytes,
        temporaries=analysis.temp_size_in_bytes if analysis is not None else result.bytes,
        param_bytes=0,
        param_count=0,
        per_device=config.batch_size // tpu.chips,
        accum_steps=config.grad_accum_steps,
    )
    limit = memory_check.Limit(int(headroom * tpu.hbm), "the budget of one chip")
    return memory_check.fixes(config, found, limit, devices=tpu.chips)
