"""flax variables -> PyTorch state dicts: official key sets and shapes of the full-size models,
and a bitwise round trip for every model family."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rspc_jax import models
from rspc_jax.interop import layout as torch_layout
from tests.conftest import torch_keys_manifest

MANIFESTS = (
    "deit_tiny_patch16_224",
    "deit_small_patch16_224",
    "rvt_tiny_plus",
    "rvt_small",
    "rvt_base_plus",
    "fan_tiny_8_p4_hybrid",
    "fan_small_12_p16_224",
    "xcit_nano_12_p16_224",
    "xcit_small_12_p16_224",
)
# Tiny members of each family (random weights, any input size their layout allows).
FAMILIES = {
    "deit_tiny_patch16_224": (dict(width=24, depth=2, num_heads=2), 32),
    "rvt_tiny_plus": (dict(base_dims=(8, 8), depth=(1, 1), heads=(2, 4), masked_block=1), 224),
    "fan_tiny_8_p4_hybrid": (
        dict(
            embed_dim=16,
            depth=1,
            num_heads=2,
            stem_depths=(1, 1),
            stem_dims=(8, 16),
            cls_attn_layers=1,
        ),
        32,
    ),
    "fan_tiny_12_p16_224": (dict(embed_dim=16, depth=1, num_heads=2, cls_attn_layers=1), 32),
    "xcit_nano_12_p16_224": (dict(embed_dim=16, depth=1, num_heads=2, cls_attn_layers=1), 32),
}


def _random_variables(model, image_size, seed=0):
    """Every leaf drawn at random with numpy (no flax init to compile)."""
    images = jax.ShapeDtypeStruct((1, image_size, image_size, 3), jnp.float32)
    abstract = jax.eval_shape(
        functools.partial(model.init, train=False), jax.random.PRNGKey(0), images
    )
    rng = np.random.default_rng(seed)
    return {
        c: jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32), abstract[c])
        for c in ("params", "batch_stats")
        if c in abstract
    }


@pytest.mark.parametrize("name", MANIFESTS)
def test_export_has_exactly_the_official_keys_and_shapes(name):
    model = models.create(name, num_classes=1000)
    targets = torch_layout.model_targets(model)
    abstract = {t.collection: {} for t in targets.values()}
    zeros = {c: {} for c in abstract}
    for t in targets.values():
        node = zeros[t.collection]
        for part in t.path[:-1]:
            node = node.setdefault(part, {})
        node[t.path[-1]] = np.broadcast_to(np.zeros((), np.float32), t.shape)
    exported = torch_layout.to_torch(zeros, targets)
    manifest = {
        key: (tuple(shape), dtype) for key, shape, dtype in torch_keys_manifest(name)["entries"]
    }
    assert {k: (v.shape, str(v.dtype)) for k, v in exported.items()} == {
        k: (shape, dtype.replace("torch.", "")) for k, (shape, dtype) in manifest.items()
    }


@pytest.mark.parametrize("name", FAMILIES)
def test_export_then_import_is_bitwise(name):
    overrides, image_size = FAMILIES[name]
    model = models.create(name, num_classes=7, **overrides)
    variables = _random_variables(model, image_size)
    targets = torch_layout.model_targets(model, image_size)
    state_dict = torch_layout.to_torch(variables, targets)
    assert all(v.flags["C_CONTIGUOUS"] for v in state_dict.values())
    back = torch_layout.to_flax(state_dict, targets)
    assert jax.tree.structure(back) == jax.tree.structure(variables)
    for ours, ref in zip(jax.tree.leaves(back), jax.tree.leaves(variables)):
        np.testing.assert_array_equal(np.asarray(ours), ref)
