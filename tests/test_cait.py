"""CaiT against timm: parameter counts and state-dict keys/shapes of CaiT-XXS24, CaiT-S24 and
the thesis's CaiT-S12, logits in both directions, talking-heads attention against a NumPy
transcription of timm's forward, the sown blocks, and one RSPC train step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rspc_jax import models
from rspc_jax.models import cait
from tests.test_swin import (
    assert_layout_and_count,
    assert_logits_match,
    assert_remat_recomputes_with_the_same_gradients,
    assert_rspc_step_is_sound,
    rspc_train_step,
    sown_shapes,
    timm_reference,
)

# timm 1.0.31, 1000 classes; CaiT-S12 is timm's CaiT-S24 cut to 12 blocks, the thesis's
# "25.61M" (docs/models.md, 'CaiT').
PARAMETERS = {
    "cait_xxs24_224": ("cait_xxs24_224", 11_956_264),
    "cait_s24_224": ("cait_s24_224", 46_916_200),
    "cait_s12_224": ('cait_s24_224:{"depth": 12}', 25_611_688),
}
PARITY = 'cait_xxs24_224:{"depth": 2}'  # every mechanism; 2 of the 24 LayerScale blocks
TINY = dict(embed_dim=16, depth=2, num_heads=2, depth_token_only=1, patch_size=8)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    specs = [spec for spec, _ in PARAMETERS.values()]
    return timm_reference(tmp_path_factory.mktemp("timm"), [PARITY], specs)


def test_every_size_has_timm_parameter_count_keys_and_shapes(reference):
    for name, (spec, count) in PARAMETERS.items():
        assert_layout_and_count(name, reference["shapes"][spec], count)


def test_s12_initialises_layer_scale_to_the_thesis_value():
    """0.1 up to depth 18 (CaiT paper, thesis 2.3.3); timm's 24-block models use 1e-5."""
    assert models.create("cait_s24_224", num_classes=10).init_values == 1e-5
    init_values = models.create("cait_s12_224", num_classes=10).init_values
    x = jnp.zeros((1, 4, 8))
    blocks = (
        cait.LayerScaleBlock(2, init_values=init_values).init(jax.random.PRNGKey(0), x, False),
        cait.LayerScaleBlockClassAttn(2, init_values=init_values).init(
            jax.random.PRNGKey(0), x, x[:, :1], train=False
        ),
    )
    for params in blocks:
        for gamma in ("gamma_1", "gamma_2"):
            np.testing.assert_array_equal(params["params"][gamma], np.float32(0.1))


def test_logits_match_timm_in_both_directions(reference):
    assert_logits_match(reference["logits"])


def _timm_talking_heads(x, qkv_w, qkv_b, l_w, l_b, w_w, w_b, proj_w, proj_b, heads):
    """timm `TalkingHeadAttn.forward` step by step, with its permutes, in NumPy (float64)."""
    batch, tokens, dim = x.shape
    qkv = (x @ qkv_w.T + qkv_b).reshape(batch, tokens, 3, heads, dim // heads)
    q, k, v = qkv.transpose(2, 0, 3, 1, 4)  # (B, h, N, d) each
    attn = (q * (dim // heads) ** -0.5) @ k.transpose(0, 1, 3, 2)
    attn = (attn.transpose(0, 2, 3, 1) @ l_w.T + l_b).transpose(0, 3, 1, 2)
    attn = np.exp(attn - attn.max(-1, keepdims=True))
    attn /= attn.sum(-1, keepdims=True)
    mixed = (attn.transpose(0, 2, 3, 1) @ w_w.T + w_b).transpose(0, 3, 1, 2)
    out = (mixed @ v).transpose(0, 2, 1, 3).reshape(batch, tokens, dim)
    return out @ proj_w.T + proj_b, attn


def test_talking_heads_attention_matches_timm():
    rng = np.random.default_rng(0)
    batch, tokens, dim, heads = 2, 7, 12, 3
    x = rng.normal(size=(batch, tokens, dim))
    shapes = dict(
        qkv_w=(3 * dim, dim),
        qkv_b=(3 * dim,),
        l_w=(heads, heads),
        l_b=(heads,),
        w_w=(heads, heads),
        w_b=(heads,),
        proj_w=(dim, dim),
        proj_b=(dim,),
    )
    weights = {key: rng.normal(size=shape) * 0.5 for key, shape in shapes.items()}
    params = {
        name: {"kernel": weights[f"{key}_w"].T, "bias": weights[f"{key}_b"]}
        for name, key in (("qkv", "qkv"), ("proj_l", "l"), ("proj_w", "w"), ("proj", "proj"))
    }
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    with jax.default_matmul_precision("highest"):
        out, attn = cait.TalkingHeadAttn(heads).apply(
            {"params": params}, jnp.asarray(x, jnp.float32), train=False
        )
    ref_out, ref_attn = _timm_talking_heads(x, heads=heads, **weights)
    np.testing.assert_allclose(out, ref_out, atol=1e-5)
    np.testing.assert_allclose(attn, ref_attn, atol=1e-6)  # the sown map: softmax rows


def test_sows_every_self_attention_block_and_the_class_attention_rows():
    model = models.create("cait_xxs24_224", num_classes=1000)
    logits, sown = sown_shapes(model)
    assert logits.shape == (2, 1000) and model.patch_size == 16
    assert [b.shape for b in sown["block_outputs"]] == [(2, 196, 192)] * 24
    assert [a.shape for a in sown["attention_maps"]] == [(2, 4, 196, 196)] * 24
    assert [a.shape for a in sown["class_attention_maps"]] == [(2, 4, 1, 197)] * 2


def test_rspc_train_step_is_finite_and_moves_classifier_and_corruption_model(digits_data_dir):
    before, after, metrics = rspc_train_step(digits_data_dir, "cait_s12_224", TINY)
    assert_rspc_step_is_sound(before, after, metrics)


def test_remat_recomputes_the_blocks_with_the_same_gradients():
    assert_remat_recomputes_with_the_same_gradients("cait_s12_224", dict(TINY, depth=1))
