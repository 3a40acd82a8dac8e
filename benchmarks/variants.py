"""The train-step variants the benchmark times: a name, optionally followed by
@CHOICE=VALUE parts that trace and jit it with those implementation choices of
rspc_jax.models.ops ('rspc@cpu_products=xla'), so that two variants of one command are a
same-process A/B of a backend choice."""

import contextlib

from rspc_jax import ConfigError
from rspc_jax.models import ops
from rspc_jax.tools import memory_plan

# 'plain_2x' is the plain step on twice the batch, the images RSPC's one forward puts through
# the classifier: rspc / plain_2x is what RSPC costs beyond the doubled batch, which alone can
# take more than twice the time once a step's buffers outgrow the caches.
STEP_VARIANTS = (*memory_plan.STEP_VARIANTS, "plain_2x")

# (variant, baseline, the time ratio expected if nothing but the images' number mattered).
_COMPARISONS = (("rspc", "plain", 2.0), ("rspc", "plain_2x", 1.0), ("plain_2x", "plain", 2.0))


def choices_of(name: str) -> dict[str, str]:
    """The implementation choices after '@' in a variant's name, checked."""
    choices = {}
    for setting in name.split("@")[1:]:
        choice, separator, value = setting.partition("=")
        if not separator:
            raise ConfigError(f"--variants={name}: write each choice as @CHOICE=VALUE")
        choices[choice] = value
    try:
        ops.check_choices(choices)
    except ConfigError as error:
        raise ConfigError(f"--variants={name}: {error}") from None
    return choices


def check_variants(names: list[str]) -> None:
    """Refuses an unknown variant, choice or value before any step is built."""
    memory_plan.check_variants([name.split("@")[0] for name in names], STEP_VARIANTS)
    for name in names:
        choices_of(name)


def implementations(name: str) -> contextlib.AbstractContextManager:
    """The block in which variant `name`'s step is traced and jitted."""
    return ops.implementations(**choices_of(name))


def variant_config(config, name: str):
    """A copy of `config` switched to variant `name` (its choices aside: `implementations`)."""
    base = name.split("@")[0]
    if base == "plain_2x":
        config = memory_plan.variant_config(config, "plain")
        config.batch_size *= 2
        return config
    return memory_plan.variant_config(config, base)


def step_comparisons(variants) -> list[tuple[str, str, float]]:
    """(variant, baseline, expected ratio) of the comparisons whose two variants were both
    run: rspc / plain, rspc / plain_2x and plain_2x / plain."""
    return [c for c in _COMPARISONS if {c[0], c[1]} <= set(variants)]
