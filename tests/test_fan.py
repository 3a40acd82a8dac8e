"""FAN-Hybrid against the official PyTorch code: sizes, state-dict layout, every eval fixture
of kind fan_classifier, sown FAN blocks, and one RSPC training step (tolerances:
docs/testing.md, "Reference fixtures and skips")."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rspc_jax import models, rspc
from rspc_jax.interop import layout as torch_layout
from rspc_jax.interop import state_dicts as interop
from rspc_jax.models import fan
from tests.conftest import (
    FIXTURES,
    activation_tol,
    assert_close,
    fixture_cases,
    load_case,
    official_model,
    torch_keys_manifest,
)

VARIANTS = (
    "fan_tiny_8_p4_hybrid",
    "fan_small_12_p4_hybrid",
    "fan_base_16_p4_hybrid",
    "fan_large_16_p4_hybrid",
    "fan_tiny_12_p16_224",
    "fan_small_12_p16_224",
)
IMAGES_224 = jax.ShapeDtypeStruct((2, 224, 224, 3), jnp.float32)


def _zeros_like_manifest(entries) -> dict:
    """A weightless state dict (broadcast views) with the manifest's keys and shapes."""
    return {key: np.broadcast_to(np.zeros((), dtype), shape) for key, shape, dtype in entries}


@pytest.mark.parametrize("name", VARIANTS)
def test_full_size_parameter_count_and_official_keys(name):
    manifest = torch_keys_manifest(name)
    params_json = json.loads((FIXTURES.parent / "torch_keys" / "params.json").read_text())
    targets = torch_layout.model_targets(models.create(name, num_classes=1000))
    count = sum(int(np.prod(t.shape)) for t in targets.values() if t.collection == "params")
    assert count == params_json["models"][name]["num_parameters"]
    # Every official key and shape has exactly one flax counterpart.
    torch_layout.check_state_dict(_zeros_like_manifest(manifest["entries"]), targets)


def test_converter_lists_missing_unexpected_and_misshaped_keys():
    state = _zeros_like_manifest(torch_keys_manifest("fan_tiny_8_p4_hybrid")["entries"])
    del state["blocks.3.mlp.mlp_v.dwconv.bn.running_var"]
    state["pos_embeder.token_projection.bias"] = np.zeros((192,), np.float32)
    state["blocks.0.mlp.temperature"] = np.zeros((8,), np.float32)
    with pytest.raises(ValueError) as error:
        interop.load_variables(
            state,
            _abstract_init(models.create("fan_tiny_8_p4_hybrid", num_classes=1000), IMAGES_224),
        )
    message = str(error.value)
    for part in (
        "missing (1): blocks.3.mlp.mlp_v.dwconv.bn.running_var",
        "unexpected (1): pos_embeder.token_projection.bias",
        "blocks.0.mlp.temperature: (8,) -> (8,), expected (8, 1, 1)",
    ):
        assert part in message


def _nchw_to_tokens(x):
    return x.reshape(*x.shape[:2], -1).transpose(0, 2, 1)


@pytest.mark.parametrize("case", fixture_cases("fan_classifier"))
def test_reduced_fixture_eval_parity(case):
    case = load_case(case, "fan_classifier")
    config, ref = case.config, case.outputs
    model = official_model(config["constructor"], case.image_shape)
    variables = interop.init_and_load(model, case.state_dict(), image_size=case.image_shape[0])
    debug = ("backbone", "patch_embed", "pos_embed", "norm") + tuple(
        f"cls_attn_blocks_{i}" for i in range(model.cls_attn_layers)
    )
    forward = jax.jit(
        functools.partial(
            model.apply,
            train=False,
            mutable=["intermediates"],
            capture_intermediates=lambda m, _: m.name in debug,
        )
    )
    with jax.default_matmul_precision("highest"):
        logits, state = forward(variables, case.inputs["x_nhwc"])
    captured = {
        name: state["intermediates"][name]["__call__"][0] for name in debug if name != "backbone"
    }
    ours = {
        "logits": logits,
        "patch_embed": np.asarray(captured["patch_embed"]).reshape(ref["patch_embed"].shape),
        "pos_encoding": captured["pos_embed"],
        "features": captured["norm"][:, 0],
    }
    if model.hybrid:  # the ConvNeXt stem's output (FAN-ViT has no backbone)
        ours["backbone_features"] = np.asarray(
            state["intermediates"]["patch_embed"]["backbone"]["__call__"][0]
        ).transpose(0, 3, 1, 2)
    ours.update(
        {
            f"cls_attn_block_{i:02d}": captured[f"cls_attn_blocks_{i}"][0]  # (x, attn)
            for i in range(model.cls_attn_layers)
        }
    )
    blocks = state["intermediates"]["block_outputs"]
    assert [f"block_{i:02d}" for i in range(len(blocks))] == list(config["block_modules"])
    ours.update({f"block_{i:02d}": tokens for i, tokens in enumerate(blocks)})
    assert set(ours) == set(ref)
    for key, value in ours.items():
        tol = 1e-4 if key == "logits" else activation_tol(ref[key])
        assert_close(value, ref[key], tol, key)


def _abstract_init(model, images):
    return jax.eval_shape(functools.partial(model.init, train=False), jax.random.PRNGKey(0), images)


@pytest.mark.parametrize(
    "name, blocks, heads", [("fan_tiny_8_p4_hybrid", 8, 8), ("fan_tiny_12_p16_224", 12, 4)]
)
def test_tiny_sows_every_fan_block_in_forward_order(name, blocks, heads):
    model = models.create(name, num_classes=1000)
    _, state = jax.eval_shape(
        functools.partial(model.apply, train=False, mutable=["intermediates"], sow_attention=True),
        _abstract_init(model, IMAGES_224),
        IMAGES_224,
    )
    intermediates = state["intermediates"]
    assert [b.shape for b in intermediates["block_outputs"]] == [(2, 196, 192)] * blocks
    assert [m.shape for m in intermediates["attention_maps"]] == [(2, heads, 196, 196)] * blocks
    # The class token's attention rows over [cls; patches], one per class-attention block.
    assert [m.shape for m in intermediates["class_attention_maps"]] == [(2, heads, 1, 197)] * 2


def test_fourier_encoding_matches_official_definition():
    features = fan.fourier_features((3, 5))
    k = np.arange(fan.FOURIER_HIDDEN)
    dim_t = fan.FOURIER_TEMPERATURE ** (2 * (k // 2) / fan.FOURIER_HIDDEN)
    y = np.arange(1, 4) / (3 + 1e-6) * 2 * np.pi
    expected_y = np.where(k % 2 == 0, np.sin(y[:, None] / dim_t), np.cos(y[:, None] / dim_t))
    assert features.dtype == np.float32 and features.shape == (3, 5, 2 * fan.FOURIER_HIDDEN)
    np.testing.assert_allclose(features[:, 2, : fan.FOURIER_HIDDEN], expected_y, atol=1e-6)


def test_rspc_loss_trains_a_tiny_fan():
    """One RSPC step in train mode: BatchNorm statistics update, loss and gradients are sane."""
    model = fan.FAN(
        num_classes=5,
        embed_dim=16,
        depth=1,
        num_heads=2,
        stem_depths=(1, 1),
        stem_dims=(8, 16),
        cls_attn_layers=1,
        drop_path_rate=0.1,
    )
    images = jax.random.normal(jax.random.PRNGKey(0), (2, 64, 64, 3))
    # Variables drawn with numpy: compiling flax's init on CPU costs more than the step.
    rng = np.random.default_rng(0)
    variables = jax.tree.map(
        lambda s: rng.uniform(0.5, 1.5, s.shape).astype(np.float32), _abstract_init(model, images)
    )
    corruption = rspc.PatchCorruptionModel(patch_size=16)
    corruption_params = corruption.init(jax.random.PRNGKey(2), images)["params"]
    lower, upper = rspc.normalized_limits(rspc.IMAGENET_MEAN, rspc.IMAGENET_STD)
    targets = jax.nn.one_hot(jnp.array([1, 3]), 5)
    noise = jax.random.uniform(jax.random.PRNGKey(3), images.shape)

    def loss(params):
        return rspc.rspc_loss(
            params,
            corruption_params,
            variables["batch_stats"],
            images,
            targets,
            noise,
            model=model,
            corruption_model=corruption,
            rho=0.25,
            lam=1.0,
            ste_clip=1.0,
            grad_scale=1.0,
            lower=lower,
            upper=upper,
            rngs={"dropout": jax.random.PRNGKey(4)},
        )

    (total, aux), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(variables["params"])
    assert np.isfinite(float(total)) and float(aux["align"]) > 0
    norms = [float(jnp.abs(g).max()) for g in jax.tree.leaves(grads)]
    assert all(np.isfinite(norms)) and sum(n > 0 for n in norms) > len(norms) // 2
    assert float(jnp.abs(grads["blocks_0"]["attn"]["q"]["kernel"]).max()) > 0
    changed = jax.tree.map(
        lambda a, b: bool(jnp.any(a != b)), aux["batch_stats"], variables["batch_stats"]
    )
    assert all(jax.tree.leaves(changed))
