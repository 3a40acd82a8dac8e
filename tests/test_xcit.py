"""XCiT against timm: parameter counts and state-dict layout of the full-size models, XCA
against a NumPy transcription of timm's forward, and the sown blocks and channel maps."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rspc_jax import models
from rspc_jax.interop import layout as torch_layout
from rspc_jax.models import xcit
from tests.conftest import torch_keys_manifest

MANIFESTS = (
    "xcit_nano_12_p16_224",
    "xcit_tiny_12_p16_224",
    "xcit_small_12_p16_224",
    "xcit_medium_24_p16_224",
)


# timm's parameter counts of the 14 XCiT variants at 1000 classes (also in docs/models.md,
# "XCiT variants").
TIMM_PARAMETERS = {
    "xcit_nano_12_p16_224": 3_053_224,
    "xcit_tiny_12_p16_224": 6_716_272,
    "xcit_small_12_p16_224": 26_253_304,
    "xcit_tiny_24_p16_224": 12_116_896,
    "xcit_small_24_p16_224": 47_671_384,
    "xcit_medium_24_p16_224": 84_395_752,
    "xcit_large_24_p16_224": 189_096_136,
    "xcit_nano_12_p8_224": 3_049_016,
    "xcit_tiny_12_p8_224": 6_706_504,
    "xcit_small_12_p8_224": 26_213_032,
    "xcit_tiny_24_p8_224": 12_107_128,
    "xcit_small_24_p8_224": 47_631_112,
    "xcit_medium_24_p8_224": 84_323_624,
    "xcit_large_24_p8_224": 188_932_648,
}


def _param_count(model) -> int:
    targets = torch_layout.model_targets(model)
    return sum(int(np.prod(t.shape)) for t in targets.values() if t.collection == "params")


def test_every_reference_xcit_has_the_official_parameter_count():
    for name, expected in TIMM_PARAMETERS.items():
        assert _param_count(models.create(name, num_classes=1000)) == expected, name


def test_thesis_m12_and_l12_are_the_24_layer_models_cut_to_12_blocks():
    """M12/L12 exist only in the thesis: the 24-layer model minus 12 XCA blocks."""
    for size in ("medium", "large"):
        deep = models.create(f"xcit_{size}_24_p16_224", num_classes=1000)
        shallow = models.create(f"xcit_{size}_12_p16_224", num_classes=1000)
        block = (_param_count(deep) - _param_count(shallow)) / 12
        dim = deep.embed_dim
        # gammas, 3 LayerNorms, XCA (temperature, qkv, proj), LPI (2 dw convs, BN), MLP
        expected = (
            3 * dim
            + 6 * dim
            + deep.num_heads
            + 3 * dim * dim
            + 3 * dim
            + dim * dim
            + dim
            + 2 * (9 * dim + dim)
            + 2 * dim
            + 8 * dim * dim
            + 5 * dim
        )
        assert block == expected and shallow.eta == 1.0 and shallow.depth == 12


@pytest.mark.parametrize("name", MANIFESTS)
def test_full_size_state_dict_keys_and_shapes_match_timm(name):
    entries = torch_keys_manifest(name)["entries"]
    state = {key: np.broadcast_to(np.zeros((), dtype), shape) for key, shape, dtype in entries}
    torch_layout.check_state_dict(
        state, torch_layout.model_targets(models.create(name, num_classes=1000))
    )


def _timm_xca(x, qkv_w, qkv_b, proj_w, proj_b, temperature, heads):
    """timm `XCA.forward` step by step, with its permutes, in NumPy (float64)."""
    batch, tokens, dim = x.shape
    qkv = (x @ qkv_w.T + qkv_b).reshape(batch, tokens, 3, heads, dim // heads)
    q, k, v = qkv.transpose(2, 0, 3, 4, 1)  # (B, h, d, N) each
    q = q / np.maximum(np.linalg.norm(q, axis=-1, keepdims=True), 1e-12)
    k = k / np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1e-12)
    attn = (q @ k.transpose(0, 1, 3, 2)) * temperature  # (B, h, d, d)
    attn = np.exp(attn - attn.max(-1, keepdims=True))
    attn /= attn.sum(-1, keepdims=True)
    out = (attn @ v).transpose(0, 3, 1, 2).reshape(batch, tokens, dim)
    return out @ proj_w.T + proj_b, attn


def test_cross_covariance_attention_matches_timm():
    rng = np.random.default_rng(0)
    batch, tokens, dim, heads = 2, 10, 12, 3
    x = rng.normal(size=(batch, tokens, dim))
    weights = dict(
        qkv_w=rng.normal(size=(3 * dim, dim)) * 0.3,
        qkv_b=rng.normal(size=3 * dim),
        proj_w=rng.normal(size=(dim, dim)) * 0.3,
        proj_b=rng.normal(size=dim),
        temperature=rng.uniform(0.5, 2.0, size=(heads, 1, 1)),
    )
    params = {
        "temperature": weights["temperature"],
        "qkv": {"kernel": weights["qkv_w"].T, "bias": weights["qkv_b"]},
        "proj": {"kernel": weights["proj_w"].T, "bias": weights["proj_b"]},
    }
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    with jax.default_matmul_precision("highest"):
        out, attn = xcit.XCA(heads).apply({"params": params}, jnp.asarray(x, jnp.float32))
    ref_out, ref_attn = _timm_xca(x, heads=heads, **weights)
    np.testing.assert_allclose(out, ref_out, atol=1e-5)
    np.testing.assert_allclose(attn, ref_attn, atol=1e-6)


def _sown(model, image_size):
    images = jax.ShapeDtypeStruct((2, image_size, image_size, 3), jnp.float32)
    variables = jax.eval_shape(
        functools.partial(model.init, train=False), jax.random.PRNGKey(0), images
    )
    logits, state = jax.eval_shape(
        functools.partial(model.apply, train=False, mutable=["intermediates"], sow_attention=True),
        variables,
        images,
    )
    return logits, state["intermediates"], variables


def test_sows_every_xca_block_and_its_channel_attention():
    model = models.create("xcit_nano_12_p16_224", num_classes=1000)
    logits, sown, _ = _sown(model, 224)
    assert logits.shape == (2, 1000)
    assert [b.shape for b in sown["block_outputs"]] == [(2, 196, 128)] * 12
    assert [a.shape for a in sown["attention_maps"]] == [(2, 4, 32, 32)] * 12
    assert [a.shape for a in sown["class_attention_maps"]] == [(2, 4, 1, 197)] * 2


def test_patch_4_reuses_the_patch_16_weights_on_32px_inputs():
    """The thesis's CIFAR stem: stride 1 in the first two convs, 8x8 tokens at 32 px."""
    p16 = models.create("xcit_tiny_12_p16_224", num_classes=10)
    p4 = models.create("xcit_tiny_12_p16_224", num_classes=10, patch_size=4)
    _, sown, variables = _sown(p4, 32)
    assert sown["block_outputs"][0].shape == (2, 64, 192)
    assert jax.tree.map(lambda a: a.shape, variables) == jax.tree.map(
        lambda a: a.shape, _sown(p16, 224)[2]
    )
    with pytest.raises(ValueError, match="patch sizes \\[4, 8, 16\\], got 2"):
        _sown(models.create("xcit_tiny_12_p16_224", num_classes=10, patch_size=2), 32)
