"""RVT / RVT* against the official PyTorch code: sizes, state-dict layout, every eval fixture
of kind rvt_classifier (the RSPC training-step fixtures: tests/test_rspc.py; tolerances:
docs/testing.md, "Reference fixtures and skips")."""

import functools
import json

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rspc_jax import models
from rspc_jax.interop import layout as torch_layout
from rspc_jax.interop import state_dicts as interop
from rspc_jax.models import rvt
from tests.conftest import (
    FIXTURES,
    activation_tol,
    assert_close,
    fixture_cases,
    load_case,
    official_model,
    torch_keys_manifest,
)

VARIANTS = ("rvt_tiny", "rvt_tiny_plus", "rvt_small", "rvt_small_plus", "rvt_base", "rvt_base_plus")
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
    assert count == params_json["models"][name]["num_parameters"] == manifest["num_parameters"]
    # Every official key and shape has exactly one flax counterpart.
    torch_layout.check_state_dict(_zeros_like_manifest(manifest["entries"]), targets)


def test_converter_lists_missing_unexpected_and_misshaped_keys():
    state = _zeros_like_manifest(torch_keys_manifest("rvt_tiny_plus")["entries"])
    del state["transformers.1.blocks.0.mlp.bn2.running_var"]
    state["pos_embed"] = np.zeros((1, 196, 192), np.float32)
    state["pools.0.conv.weight"] = np.zeros((384, 2, 3, 3), np.float32)
    with pytest.raises(ValueError) as error:
        interop.load_variables(
            state, _abstract_init(models.create("rvt_tiny_plus", num_classes=1000), IMAGES_224)
        )
    message = str(error.value)
    for part in (
        "missing (1): transformers.1.blocks.0.mlp.bn2.running_var",
        "unexpected (1): pos_embed",
        "pools.0.conv.weight: (384, 2, 3, 3)",
    ):
        assert part in message


@pytest.mark.parametrize("case", fixture_cases("rvt_classifier"))
def test_reduced_fixture_eval_parity(case):
    case = load_case(case, "rvt_classifier")
    config, ref = case.config, case.outputs
    model = official_model(config["constructor"], case.image_shape)
    variables = interop.init_and_load(model, case.state_dict(), image_size=case.image_shape[0])
    debug = {"patch_embed": "stem", "norm": "features"}
    debug.update({f"pools_{i}": f"pool_{i:02d}" for i in range(len(model.depth) - 1)})
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
    assert_close(logits, ref["logits"], 1e-4, "logits")
    blocks = state["intermediates"]["block_outputs"]
    assert [f"block_{i:02d}" for i in range(len(blocks))] == list(config["block_modules"])
    for i, tokens in enumerate(blocks):
        key = f"block_{i:02d}"
        assert tokens.shape == ref[key].shape
        assert_close(tokens, ref[key], activation_tol(ref[key]), key)
    for module, key in debug.items():
        if key in ref:
            ours = state["intermediates"][module]["__call__"][0]
            ours = ours.transpose(0, 3, 1, 2) if ours.ndim == 4 else ours  # NHWC -> NCHW
            assert_close(ours, ref[key], activation_tol(ref[key]), key)


def _abstract_init(model, images):
    return jax.eval_shape(functools.partial(model.init, train=False), jax.random.PRNGKey(0), images)


def _abstract_intermediates(model, images, **kwargs):
    _, state = jax.eval_shape(
        functools.partial(model.apply, train=False, mutable=["intermediates"], **kwargs),
        _abstract_init(model, images),
        images,
    )
    return state["intermediates"]


def _abstract_block_outputs(model, images):
    return _abstract_intermediates(model, images)["block_outputs"]


def test_tiny_plus_sows_every_block_in_forward_order():
    model = models.create("rvt_tiny_plus", num_classes=1000)
    intermediates = _abstract_intermediates(model, IMAGES_224, sow_attention=True)
    blocks = intermediates["block_outputs"]
    assert [b.shape for b in blocks] == [(2, 196, 192)] * 10 + [(2, 49, 384)] * 2
    maps = intermediates["attention_maps"]
    assert [m.shape for m in maps] == [(2, 6, 196, 196)] * 10 + [(2, 12, 49, 49)] * 2
    paas = {
        k[:2]
        for k in flax.traverse_util.flatten_dict(_abstract_init(model, IMAGES_224)["params"])
        if k[-1] == "att_mask"
    }
    assert paas == {("transformers_0", f"blocks_{i}") for i in range(10)}


def test_paas_mask_follows_the_init_size_and_rejects_another():
    images_256 = jax.ShapeDtypeStruct((2, 256, 256, 3), jnp.float32)
    model = models.create("rvt_tiny_plus", num_classes=10)
    masks = {
        v.shape
        for k, v in flax.traverse_util.flatten_dict(
            _abstract_init(model, images_256)["params"]
        ).items()
        if k[-1] == "att_mask"
    }
    assert masks == {(6, 256, 256)}
    variables_224 = _abstract_init(model, IMAGES_224)
    with pytest.raises(
        ValueError,
        match=r"att_mask \(6, 196, 196\) was made for 196 tokens, "
        r"the input has 256.*init_resize",
    ):
        jax.eval_shape(functools.partial(model.apply, train=False), variables_224, images_256)
    blocks = _abstract_block_outputs(models.create("rvt_tiny", num_classes=10), images_256)
    assert [b.shape for b in blocks] == [(2, 256, 192)] * 10 + [(2, 64, 384)] * 2


def _micro_rvt(**overrides) -> rvt.RVT:
    return rvt.RVT(num_classes=3, base_dims=(4, 4), depth=(1, 1), heads=(2, 4), **overrides)


@pytest.fixture(scope="module")
def micro():
    """Variables of `_micro_rvt` drawn with numpy (compiling flax's init on CPU costs more
    than the tests): N(0, 0.5^2) parameters, BatchNorm statistics in [0.5, 1.5]; a batch."""
    images = jax.random.normal(jax.random.PRNGKey(0), (4, 64, 64, 3))
    abstract = _abstract_init(_micro_rvt(), images)
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda s: rng.normal(0, 0.5, s.shape).astype(np.float32), abstract["params"]
    )
    stats = jax.tree.map(
        lambda s: rng.uniform(0.5, 1.5, s.shape).astype(np.float32), abstract["batch_stats"]
    )
    return {"params": params, "batch_stats": stats}, images


def test_stochastic_depth_follows_the_dropout_rng_and_is_off_in_eval(micro):
    variables, images = micro
    model = _micro_rvt(drop_path_rate=0.5)

    @jax.jit
    def train_logits(seed):
        logits, _ = model.apply(
            variables,
            images,
            train=True,
            mutable=["batch_stats"],
            rngs={"dropout": jax.random.PRNGKey(seed)},
        )
        return logits

    np.testing.assert_array_equal(train_logits(0), train_logits(0))
    assert np.abs(train_logits(0) - train_logits(1)).max() > 1e-4
    eval_logits = jax.jit(functools.partial(model.apply, train=False))
    np.testing.assert_array_equal(eval_logits(variables, images), eval_logits(variables, images))


def test_cross_device_batchnorm_averages_statistics_over_the_axis(micro):
    variables, images = micro

    def batch_stats(module, x):
        return module.apply(variables, x, train=True, mutable=["batch_stats"])[1]

    whole = jax.jit(functools.partial(batch_stats, _micro_rvt()))(images)
    sharded = _micro_rvt(bn_axis_name="data")
    split = jax.jit(jax.vmap(functools.partial(batch_stats, sharded), axis_name="data"))(
        images.reshape(2, 2, *images.shape[1:])
    )
    for ours, expected in zip(jax.tree.leaves(split), jax.tree.leaves(whole)):
        np.testing.assert_allclose(ours[0], expected, rtol=1e-5, atol=1e-6)
