"""PyTorch interop: checkpoint files and containers, strict errors, head reset, grid
interpolation, and logits parity with timm in both directions (needs torch + timm,
which requirements-test.txt installs; the numpy-only tests run without them)."""

import argparse
import functools
import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rspc_jax import ReportedError, models
from rspc_jax.interop import state_dicts as interop
from tests.conftest import assert_trees_equal, run_python

TINY_RVT_PLUS = dict(base_dims=(8, 8), depth=(1, 1), heads=(2, 4), masked_block=1)
TINY_DEIT = dict(width=24, depth=2, num_heads=2)


def _abstract(model, image_size):
    return jax.eval_shape(
        functools.partial(model.init, train=False),
        jax.random.PRNGKey(0),
        jax.ShapeDtypeStruct((1, image_size, image_size, 3), jnp.float32),
    )


def _random(model, image_size, seed=0):
    """Variables of `model` drawn with numpy (no init to compile); variances positive."""
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        value = rng.normal(size=leaf.shape).astype(np.float32)
        return np.abs(value) if path[-1].key == "var" else value

    abstract = _abstract(model, image_size)
    return jax.tree_util.tree_map_with_path(
        draw, {c: abstract[c] for c in ("params", "batch_stats") if c in abstract}
    )


@pytest.fixture(scope="module")
def tiny_rvt():
    model = models.create("rvt_tiny_plus", num_classes=5, **TINY_RVT_PLUS)
    return model, _random(model, 224)


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_numpy_formats_round_trip_bitwise_without_torch(tiny_rvt, tmp_path, suffix):
    _, variables = tiny_rvt
    state_dict = interop.export_state_dict(variables)
    path = str(tmp_path / f"model{suffix}")
    if suffix == ".npz":
        np.savez(path, **state_dict)
    else:
        interop.save_safetensors(path, state_dict)
    assert_trees_equal(interop.load_checkpoint(path, variables), variables)


def test_torch_containers_and_module_prefix_unwrap_to_the_same_weights(tiny_rvt, tmp_path):
    pytest.importorskip("torch")
    _, variables = tiny_rvt
    raw = interop.export_state_dict(variables)
    ema = {k: v + 1 if v.dtype == np.float32 else v for k, v in raw.items()}
    ema_variables = jax.tree.map(lambda v: v + 1, variables)
    ddp = {f"module.{k}": v for k, v in raw.items()}
    files = {
        "saver.pth.tar": (
            {"state_dict": ddp, "state_dict_ema": ema, "arch": "rvt", "epoch": 3},
            True,
        ),
        "deit.pth": ({"model": raw, "model_ema": ema}, True),
        "bare.pth": (raw, False),
    }
    for name, (payload, has_ema) in files.items():
        path = str(tmp_path / name)
        interop.save_torch(path, payload)
        assert_trees_equal(interop.load_checkpoint(path, variables), variables)
        if has_ema:
            assert_trees_equal(interop.load_checkpoint(path, variables, ema=True), ema_variables)
    with pytest.raises(ValueError, match="bare state dict with one set of weights"):
        interop.read_state_dict(str(tmp_path / "bare.pth"), ema=True)
    interop.save_torch(str(tmp_path / "other.pth"), {"optimizer": raw, "epoch": 1})
    with pytest.raises(
        ValueError, match=r"no 'state_dict' or 'model' entry .*'epoch', 'optimizer'"
    ):
        interop.read_state_dict(str(tmp_path / "other.pth"))


def test_mismatched_checkpoint_lists_every_problem_and_loads_nothing(tiny_rvt, tmp_path):
    _, variables = tiny_rvt
    state_dict = interop.export_state_dict(variables)
    del state_dict["norm.weight"]
    state_dict["pos_embed"] = np.zeros((1, 196, 16), np.float32)
    state_dict["head.weight"] = np.zeros((1000, 32), np.float32)
    state_dict["head.bias"] = np.zeros((1000,), np.float32)
    path = str(tmp_path / "wrong.safetensors")
    interop.save_safetensors(path, state_dict)
    with pytest.raises(ValueError) as error:
        interop.load_checkpoint(path, variables)
    message = str(error.value)
    for part in (
        f"checkpoint {path} does not fit the model",
        "missing (1): norm.weight",
        "unexpected (1): pos_embed",
        "head.weight: (1000, 32) -> (32, 1000), expected (32, 5)",
        "head.bias: (1000,)",
        "config.init_head='reset'",
    ):
        assert part in message


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_truncated_or_missing_file_gives_a_clear_error(tiny_rvt, tmp_path, suffix):
    if suffix == ".pth":
        pytest.importorskip("torch")
    _, variables = tiny_rvt
    path = tmp_path / f"model{suffix}"
    save = interop.save_safetensors if suffix == ".safetensors" else interop.save_torch
    save(str(path), interop.export_state_dict(variables))
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(
        ValueError, match=f"could not read checkpoint {path} .*is the file complete"
    ):
        interop.load_checkpoint(str(path), variables)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        interop.load_checkpoint(str(tmp_path / f"absent{suffix}"), variables)


class _Payload:
    """A pickled object whose loading would run code: it would create `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


@pytest.mark.parametrize("extra", ["namespace", "payload"])
def test_a_pth_with_python_objects_is_refused_with_how_to_convert_it(tiny_rvt, tmp_path, extra):
    torch = pytest.importorskip("torch")
    _, variables = tiny_rvt
    state_dict = {k: torch.tensor(v) for k, v in interop.export_state_dict(variables).items()}
    marker = tmp_path / "payload_ran"
    objects = argparse.Namespace(lr=0.1) if extra == "namespace" else _Payload(marker)
    path = tmp_path / "trained.pth"
    torch.save({"model": state_dict, "args": objects}, path)
    with pytest.raises(interop.CheckpointFileError) as error:
        interop.load_checkpoint(str(path), variables)
    message = str(error.value)
    assert isinstance(error.value, ReportedError)  # one paragraph from the tools
    for part in ("holds Python objects that are not tensors", "can run code", "weights_only=False"):
        assert part in message
    assert "is the file complete" not in message
    assert not marker.exists()


def test_reset_head_keeps_the_fresh_head_and_loads_the_rest(tmp_path):
    source = models.create("deit_tiny_patch16_224", num_classes=1000, **TINY_DEIT)
    trained = _random(source, 32)
    path = str(tmp_path / "in1k.safetensors")
    interop.save_safetensors(path, interop.export_state_dict(trained))
    target = models.create("deit_tiny_patch16_224", num_classes=10, **TINY_DEIT)
    fresh = _random(target, 32, seed=5)
    with pytest.raises(ValueError, match="init_head='reset'"):
        interop.load_checkpoint(path, fresh)
    loaded = interop.load_checkpoint(path, fresh, reset_head=True)
    assert_trees_equal(loaded["params"]["head"], fresh["params"]["head"])
    body = lambda tree: {k: v for k, v in tree["params"].items() if k != "head"}  # noqa: E731
    assert_trees_equal(body(loaded), body(trained))


def test_resize_interpolates_paas_masks_and_position_embeddings(tiny_rvt, tmp_path):
    model, trained = tiny_rvt
    trained = jax.tree.map(np.copy, trained)
    mask = trained["params"]["transformers_0"]["blocks_0"]["attn"]["att_mask"]
    mask[:] = 0.7
    path = str(tmp_path / "rvt.safetensors")
    interop.save_safetensors(path, interop.export_state_dict(trained))
    at_256 = _abstract(model, 256)  # the same model at 16x16 tokens
    with pytest.raises(ValueError, match=r"att_mask: \(2, 196, 196\).*init_resize=True"):
        interop.load_checkpoint(path, at_256)
    loaded = interop.load_checkpoint(path, at_256, resize=True)
    resized = np.asarray(loaded["params"]["transformers_0"]["blocks_0"]["attn"]["att_mask"])
    assert resized.shape == (2, 256, 256)
    np.testing.assert_allclose(resized, 0.7, rtol=1e-6)
    logits = jax.eval_shape(
        functools.partial(model.apply, train=False),
        loaded,
        jax.ShapeDtypeStruct((2, 256, 256, 3), jnp.float32),
    )
    assert logits.shape == (2, 5)

    # Interpolation of a 4x4 grid that varies linearly keeps it linear inside the grid.
    steps = np.arange(4, dtype=np.float32)
    mask = np.broadcast_to(
        steps[:, None, None, None] + 2 * steps[None, None, :, None], (4, 4, 4, 4)
    )  # (query row, query col, key row, key col)
    resized = interop.resize_att_mask(mask.reshape(1, 16, 16), 64).reshape(8, 8, 8, 8)
    np.testing.assert_allclose(np.diff(resized[2:6, 0, 3, 0]), 0.5, rtol=1e-5)
    np.testing.assert_allclose(np.diff(resized[4, 0, 2:6, 0]), 1.0, rtol=1e-5)

    pos = np.random.default_rng(0).normal(size=(1, 1 + 4, 8)).astype(np.float32)
    pos[0, 1:] = 3.0
    resized_pos = interop.resize_pos_embed(pos, 1 + 9)
    np.testing.assert_array_equal(resized_pos[0, 0], pos[0, 0])  # class token kept
    np.testing.assert_allclose(resized_pos[0, 1:], 3.0, rtol=1e-6)


# Full-size timm models: random init on one side, strict load on the other, same logits.
# In a fresh process that imports timm before anything else: the CUDA build of torch brings
# triton, whose LLVM crashes the process when tensorflow's is loaded first (as it is here).
TIMM_MODELS = ("deit_tiny_patch16_224", "xcit_nano_12_p16_224")


def test_timm_logits_parity_in_both_directions(tmp_path):
    if importlib.util.find_spec("timm") is None:  # importing it here would crash, see above
        pytest.skip("timm is not installed (pip install -r requirements-torch.txt)")
    result = run_python(["tests/timm_parity.py", str(tmp_path), *TIMM_MODELS], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    errors = json.loads(result.stdout.strip().splitlines()[-1])
    print(errors)  # shown with pytest -s
    assert set(errors) == set(TIMM_MODELS)
    for name, found in errors.items():
        assert found["max_abs_logit"] > 0.1  # logits that a wrong tensor would move
        for direction in ("jax_to_timm", "timm_to_jax"):
            error = found[direction]
            assert error <= 1e-4, f"{name} {direction}: max abs logit difference {error:.3g}"
