"""PyTorch state dict -> flax variables, by a mechanical rename plus layout rules.

Flax modules are named after the PyTorch attributes, with `_<i>` standing for the
ModuleList / Sequential index `.<i>` (`transformers_0/blocks_3/attn/qkv`). A flax leaf
then names one PyTorch key (`transformers.0.blocks.3.attn.qkv.weight`), and its layout
follows from the leaf kind (docs/models.md, "PyTorch layout rules"):

* `kernel` of ndim 2: Linear weight (out, in) -> (in, out);
* `kernel` of ndim >= 3: Conv weight (out, in/groups, *spatial) -> (*spatial, in/groups, out)
  (OIHW -> HWIO), depthwise and grouped convs included;
* `scale` -> `weight` (LayerNorm, BatchNorm); `batch_stats` `mean`/`var` ->
  `running_mean`/`running_var`; everything else (`bias`, `att_mask`, ...) is copied.
"""

from collections.abc import Callable
import dataclasses
import re
from typing import Any

import flax
import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from rspc_jax import models

# PyTorch buffers without a flax counterpart: accepted when present, never required.
IGNORED_SUFFIXES = (".num_batches_tracked",)

_LEAF_NAMES = {
    ("params", "kernel"): "weight",
    ("params", "scale"): "weight",
    ("batch_stats", "mean"): "running_mean",
    ("batch_stats", "var"): "running_var",
}
_INDEXED = re.compile(r"^(.*)_(\d+)$")


@dataclasses.dataclass(frozen=True)
class Target:
    """Where one PyTorch tensor goes: flax collection, path in it, shape, layout rule
    (torch -> flax) and its inverse (flax -> torch)."""

    collection: str
    path: tuple[str, ...]
    shape: tuple[int, ...]
    rule: Callable[[np.ndarray], np.ndarray]
    inverse: Callable[[np.ndarray], np.ndarray]


def linear_to_dense(weight: np.ndarray) -> np.ndarray:
    return weight.T


def conv_to_flax(weight: np.ndarray) -> np.ndarray:
    """(out, in/groups, *spatial) -> (*spatial, in/groups, out)."""
    spatial = tuple(range(2, weight.ndim))
    return weight.transpose(spatial + (1, 0))


def conv_to_torch(kernel: np.ndarray) -> np.ndarray:
    """(*spatial, in/groups, out) -> (out, in/groups, *spatial)."""
    spatial = tuple(range(kernel.ndim - 2))
    return kernel.transpose((kernel.ndim - 1, kernel.ndim - 2) + spatial)


def copy(value: np.ndarray) -> np.ndarray:
    return value


def layout_rules(leaf: str, ndim: int):
    """(torch -> flax, flax -> torch) for a leaf named `leaf` of rank `ndim`."""
    if leaf != "kernel":
        return copy, copy
    if ndim == 2:
        return linear_to_dense, linear_to_dense
    return conv_to_flax, conv_to_torch


def torch_key(collection: str, path: tuple[str, ...]) -> str:
    """("transformers_0", "blocks_1", "norm1", "scale") -> "transformers.0.blocks.1.norm1.weight"
    (collection "params")."""
    *modules, leaf = path
    names = [_INDEXED.sub(r"\1.\2", name) for name in modules]
    return ".".join(names + [_LEAF_NAMES.get((collection, leaf), leaf)])


def targets_from_flax(abstract_variables: Any) -> dict[str, Target]:
    """The PyTorch key of every leaf of `abstract_variables` (arrays or ShapeDtypeStructs)."""
    targets = {}
    for collection, tree in abstract_variables.items():
        for path, leaf in flax.traverse_util.flatten_dict(tree).items():
            key = torch_key(collection, path)
            if key in targets:
                raise ValueError(f"flax leaves {targets[key].path} and {path} both map to {key!r}")
            targets[key] = Target(
                collection, path, tuple(leaf.shape), *layout_rules(path[-1], len(leaf.shape))
            )
    return targets


def check_state_dict(state_dict: dict[str, np.ndarray], targets: dict[str, Target]) -> None:
    """Raises one ValueError listing every missing, unexpected and wrongly shaped key."""
    state_dict = {k: np.asarray(v) for k, v in state_dict.items()}
    missing = sorted(set(targets) - set(state_dict))
    unexpected = sorted(
        k for k in state_dict if k not in targets and not k.endswith(IGNORED_SUFFIXES)
    )
    wrong = [
        f"{k}: {state_dict[k].shape} -> {t.rule(state_dict[k]).shape}, expected {t.shape}"
        for k, t in targets.items()
        if k in state_dict and t.rule(state_dict[k]).shape != t.shape
    ]
    problems = [
        f"{title} ({len(keys)}): {', '.join(keys)}"
        for title, keys in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("wrongly shaped (torch -> flax layout)", wrong),
        )
        if keys
    ]
    if problems:
        raise ValueError("state dict does not match the model; " + "; ".join(problems))


def to_flax(
    state_dict: dict[str, np.ndarray], targets: dict[str, Target], dtype=jnp.float32
) -> dict:
    """Checks `state_dict` strictly against `targets`, then builds {collection: nested dict}."""
    check_state_dict(state_dict, targets)
    flat = {
        (t.collection,) + t.path: jnp.asarray(t.rule(np.asarray(state_dict[k])), dtype)
        for k, t in targets.items()
    }
    return flax.traverse_util.unflatten_dict(flat)


def to_torch(variables: dict, targets: dict[str, Target]) -> dict[str, np.ndarray]:
    """{collection: nested dict} -> state dict (PyTorch keys and layouts, numpy float32),
    plus `num_batches_tracked` = 0 for every BatchNorm, which PyTorch's strict loading
    expects (it only matters for BatchNorm with momentum=None, which no model here uses)."""
    flat = {
        collection: flax.traverse_util.flatten_dict(tree) for collection, tree in variables.items()
    }
    state = {}
    for key, t in targets.items():
        state[key] = np.ascontiguousarray(t.inverse(np.asarray(flat[t.collection][t.path])))
        if t.collection == "batch_stats" and key.endswith(".running_var"):
            state[key[: -len("running_var")] + "num_batches_tracked"] = np.zeros((), np.int64)
    return state


def model_targets(model: nn.Module, image_size: int = 224) -> dict[str, Target]:
    """The official PyTorch key of every parameter and BatchNorm statistic of `model`."""
    abstract = models.abstract_variables(model, image_size)
    return targets_from_flax({c: abstract[c] for c in ("params", "batch_stats") if c in abstract})
