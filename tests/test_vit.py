"""ViT/DeiT: parameter counts of the full-size DeiT models against timm's; the scanned
blocks (`scan_blocks`) against the unrolled ones."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rspc_jax import models
from rspc_jax.models import interventions
from tests.conftest import FIXTURES


@pytest.mark.parametrize(
    "name", ["deit_tiny_patch16_224", "deit_small_patch16_224", "deit_base_patch16_224"]
)
def test_deit_parameter_count_equals_timm(name):
    path = FIXTURES.parent / "torch_keys" / "params.json"
    if not path.is_file():
        pytest.skip(f"{path} is not available")
    expected = json.loads(path.read_text())["models"][name]["num_parameters"]
    model = models.create(name, num_classes=1000)
    images = jax.ShapeDtypeStruct((1, 224, 224, 3), jnp.float32)
    params = jax.eval_shape(
        functools.partial(model.init, train=False), jax.random.PRNGKey(0), images
    )["params"]
    assert sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params)) == expected


def _tiny_vit(**overrides):
    return models.create(
        "vit_tiny", num_classes=5, width=32, depth=3, num_heads=2, patch_size=8, **overrides
    )


def _loss_and_state(model, params, images, **kwargs):
    def loss(p):
        logits, state = model.apply({"params": p}, images, mutable=["intermediates"], **kwargs)
        return jnp.sum(logits**2), (logits, state["intermediates"])

    return jax.value_and_grad(loss, has_aux=True)(params)


@pytest.mark.parametrize("remat", [False, True])
def test_scanned_blocks_equal_unrolled_outputs_sown_features_and_gradients(remat):
    images = jax.random.normal(jax.random.PRNGKey(1), (2, 32, 32, 3))
    keep = jnp.array([[1, 0, 1, 1, 0, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1]] * 2, jnp.float32)
    unrolled, scanned = _tiny_vit(), _tiny_vit(scan_blocks=True, remat=remat)
    params = unrolled.init(jax.random.PRNGKey(0), images, train=False)["params"]
    # Init runs the unrolled blocks, so both store the same per-block tree.
    assert jax.tree.structure(
        scanned.init(jax.random.PRNGKey(0), images, train=False)
    ) == jax.tree.structure({"params": params})
    for kwargs in (dict(train=False, sow_attention=True), dict(train=False, token_keep=keep)):
        (loss, (logits, sown)), grads = _loss_and_state(unrolled, params, images, **kwargs)
        (s_loss, (s_logits, s_sown)), s_grads = _loss_and_state(scanned, params, images, **kwargs)
        np.testing.assert_allclose(s_logits, logits, rtol=1e-5, atol=1e-6)
        assert len(s_sown["block_outputs"]) == 3
        for ours, ref in zip(jax.tree.leaves(s_sown), jax.tree.leaves(sown)):
            np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6)
        for ours, ref in zip(jax.tree.leaves(s_grads), jax.tree.leaves(grads)):
            np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-6)


def test_scanned_blocks_drop_path_per_block_rate_and_refused_interventions():
    images = jax.random.normal(jax.random.PRNGKey(1), (64, 32, 32, 3))
    scanned = _tiny_vit(scan_blocks=True, drop_path_rate=0.5)
    params = scanned.init(jax.random.PRNGKey(0), images[:1], train=False)["params"]
    rngs = {"dropout": jax.random.PRNGKey(3)}
    _, sown = scanned.apply(
        {"params": params}, images, train=True, rngs=rngs, mutable=["intermediates"]
    )
    _, eval_sown = scanned.apply({"params": params}, images, train=False, mutable=["intermediates"])
    first, second = (np.asarray(sown["intermediates"]["block_outputs"][i]) for i in (0, 1))
    # Block 0's rate is 0: it matches the eval pass; block 1's (0.25) drops or rescales
    # its branches, the same way for the same key and another way for another key.
    eval_first, eval_second = (
        np.asarray(eval_sown["intermediates"]["block_outputs"][i]) for i in (0, 1)
    )
    np.testing.assert_allclose(first, eval_first, rtol=1e-5, atol=1e-6)
    assert not np.allclose(second, eval_second, rtol=1e-3, atol=1e-4)

    def second_block(key):
        return scanned.apply(
            {"params": params}, images, train=True, rngs={"dropout": key}, mutable=["intermediates"]
        )[1]["intermediates"]["block_outputs"][1]

    np.testing.assert_array_equal(second_block(rngs["dropout"]), second)
    assert not np.allclose(second_block(jax.random.PRNGKey(4)), second, rtol=1e-3, atol=1e-4)
    with pytest.raises(ValueError, match="scan_blocks=False"):
        interventions.apply(
            scanned,
            {"params": params},
            images[:1],
            interventions.Intervention(keep=interventions.keep_all(3)),
            train=False,
        )
