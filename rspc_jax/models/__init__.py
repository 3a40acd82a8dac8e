"""Model registry: `create(name, num_classes=..., **overrides)` returns a flax.linen module.

Every registered model follows one contract, which the RSPC step relies on:

* `model.apply(variables, images, train=..., sow_attention=False, ...)` returns logits;
  `images` are NHWC float arrays.
* Each backbone block's output (after both residual branches) is sown, in forward
  order, into `intermediates/block_outputs` of the top-level module.
* Attention maps (B, heads, N, N) are sown into `intermediates/attention_maps`
  only when `sow_attention=True`, so training does not pay for them.
* `model.patch_size` is the pixel size of one token (the default RSPC patch).
* `model.no_weight_decay_names` lists parameter names excluded from weight decay
  besides 1-D parameters (DeiT's `no_weight_decay()`).
"""

from collections.abc import Callable
import dataclasses
import difflib

import flax.linen as nn
import jax
import jax.numpy as jnp

from rspc_jax import ConfigError

_REGISTRY: dict[str, Callable[..., nn.Module]] = {}


def register(name: str):
    """Registers a factory `fn(num_classes, **overrides) -> nn.Module` under `name`."""

    def decorator(factory):
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is registered twice")
        _REGISTRY[name] = factory
        return factory

    return decorator


def names() -> list[str]:
    return sorted(_REGISTRY)


def create(name: str, *, num_classes: int, **overrides) -> nn.Module:
    """Builds registered model `name`; unknown names and fields fail listing the valid ones."""
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, _REGISTRY, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(f"unknown model {name!r}.{hint} Registered models: {', '.join(names())}.")
    if num_classes < 1:
        raise ConfigError(f"num_classes must be >= 1, got {num_classes}")
    try:
        return _REGISTRY[name](num_classes=num_classes, **overrides)
    except TypeError as e:
        raise ConfigError(f"bad override for model {name!r}: {e}") from e


def has_field(model: nn.Module, field: str) -> bool:
    return field in {f.name for f in dataclasses.fields(model)}


def from_config(config, num_classes: int, *, bn_axis_name: str | None = None) -> nn.Module:
    """The model of a run config: `config.model_name` with `config.model` overrides and the
    `remat` / `scan_blocks` switches; BatchNorm statistics over `bn_axis_name` when
    `config.bn_cross_device` (only the train step has that axis)."""
    model = create(config.model_name, num_classes=num_classes, **dict(config.model))
    for option in ("remat", "scan_blocks"):
        if config.get(option):
            if not has_field(model, option):
                raise ConfigError(
                    f"config.{option}=True: {config.model_name} has no {option} "
                    "option (scan_blocks: ViT/DeiT models only); set it to False"
                )
            model = model.clone(**{option: True})
    if bn_axis_name and config.bn_cross_device and has_field(model, "bn_axis_name"):
        model = model.clone(bn_axis_name=bn_axis_name)
    return model


def abstract_variables(model: nn.Module, image_size: int) -> dict:
    """Shapes and dtypes of `model`'s variables at `image_size`, without computing them."""
    return jax.eval_shape(
        lambda: model.init(
            jax.random.PRNGKey(0), jnp.zeros((1, image_size, image_size, 3)), train=False
        )
    )


# Importing the model modules registers them.
from rspc_jax.models import cait, fan, rvt, swin, vit, xcit  # noqa: E402,F401
