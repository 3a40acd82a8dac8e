"""Swin against timm: parameter counts and state-dict keys/shapes of Swin-T/S/B, logits in
both directions, windows that keep attention inside their borders (shifted ones included),
the blocks sown per stage, and one RSPC train step (shared with test_cait)."""

import functools
import importlib.util
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rspc_jax import models, parallel
from rspc_jax.data import specs as datasets
from rspc_jax.interop import layout as torch_layout
from rspc_jax.models import swin
from rspc_jax.training import setup
from tests.conftest import first_batches, run_python, smoke_config

# timm 1.0.31, 1000 classes (docs/models.md, 'Swin').
PARAMETERS = {
    "swin_tiny_patch4_window7_224": 28_288_354,
    "swin_small_patch4_window7_224": 49_606_258,
    "swin_base_patch4_window7_224": 87_768_224,
}
PARITY = "swin_tiny_patch4_window7_224"  # every mechanism, at full size
# Two stages on the 32 px digits: an 8x8 map in 4x4 windows (shifted by 2 in block 1),
# then 4x4 = one window; RSPC patch 8 px (the second stage's token).
TINY = dict(embed_dim=16, depths=(2, 1), num_heads=(1, 2), window_size=4)


def timm_reference(out_dir, logit_specs, shape_specs) -> dict:
    """tests/timm_parity.py in a fresh process: {'logits': {spec: {direction: max |logit
    difference|, 'max_abs_logit'}}, 'shapes': {spec: {key: shape}}} of timm's models."""
    if importlib.util.find_spec("timm") is None:  # importing it here crashes: see test_interop
        pytest.skip("timm is not installed (pip install -r requirements-torch.txt)")
    args = ["tests/timm_parity.py", str(out_dir), *logit_specs, "--shapes", *shape_specs]
    result = run_python(args, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    print(found["logits"])  # shown with pytest -s
    assert set(found["logits"]) == set(logit_specs)
    return found


def assert_logits_match(errors: dict) -> None:
    for spec, found in errors.items():
        assert found["max_abs_logit"] > 0.1  # logits that a wrong tensor would move
        for direction in ("jax_to_timm", "timm_to_jax"):
            assert found[direction] <= 1e-4, f"{spec} {direction}: {found[direction]:.3g}"


def assert_layout_and_count(name: str, timm_shapes: dict, count: int) -> None:
    """Registered model `name` has `count` parameters and exactly timm's state-dict keys
    and shapes `timm_shapes`."""
    targets = torch_layout.model_targets(models.create(name, num_classes=1000))
    ours = sum(int(np.prod(t.shape)) for t in targets.values() if t.collection == "params")
    assert ours == count, name
    state = {key: np.zeros(shape, np.float32) for key, shape in timm_shapes.items()}
    torch_layout.check_state_dict(state, targets)  # strict: missing, unexpected, shapes
    assert len(targets) == len(state), name


def rspc_train_step(data_dir: str, name: str, overrides: dict):
    """One real RSPC train step (setup.build's step: corruption model, STE, ascent) on the
    digits; returns (state before, state after, metrics), all on the host."""
    config = smoke_config(
        data_dir,
        model_name=name,
        model=dict(overrides, drop_path_rate=0.1),
        batch_size=4,
        **{"rspc.rho": 0.25},
    )
    spec = datasets.dataset_spec(config.dataset)
    model = setup.build_model(config, spec.num_classes)
    setup.check_model_fits(config, model)
    mesh = parallel.create_mesh()
    parts = setup.build(config, model, spec, mesh, steps_per_epoch=10, total_steps=10)
    (batch,) = first_batches(config)
    state = parts.init(jax.random.PRNGKey(0))
    before = jax.device_get(state)  # the step donates its input
    after, metrics = parts.train_step(state, parallel.to_global(batch, mesh))
    return before, jax.device_get(after), jax.device_get(metrics)


def assert_rspc_step_is_sound(before, after, metrics) -> None:
    for key in ("loss", "ce", "align", "grad_norm", "corruption_grad_norm"):
        assert np.isfinite(metrics[key]), key
    assert metrics["align"] > 0 and metrics["corruption_grad_norm"] > 0
    assert metrics["occluded_fraction"] == pytest.approx(0.25)
    for old, new in (
        (before.params, after.params),
        (before.corruption_params, after.corruption_params),
    ):
        leaves = list(zip(jax.tree.leaves(old), jax.tree.leaves(new)))
        assert all(np.isfinite(b).all() for _, b in leaves)
        assert any(not np.array_equal(a, b) for a, b in leaves)


def assert_remat_recomputes_with_the_same_gradients(name: str, overrides: dict) -> None:
    """`remat=True` puts the blocks under jax.checkpoint and leaves the gradients unchanged."""
    model = models.create(name, num_classes=5, **overrides)
    images = jax.random.normal(jax.random.PRNGKey(0), (2, 16, 16, 3))
    abstract = models.abstract_variables(model, 16)["params"]  # drawn, not initialised:
    rng = np.random.default_rng(0)  # flax's init would compile or dispatch op by op
    params = jax.tree.map(lambda a: rng.normal(0, 0.2, a.shape).astype(np.float32), abstract)

    def loss(m):
        return lambda p: jnp.sum(m.apply({"params": p}, images, train=False) ** 2)

    remat = model.clone(remat=True)
    checkpointed = re.compile(r"\b(checkpoint|remat2?)\[")  # the primitive's name by JAX version
    assert checkpointed.search(str(jax.make_jaxpr(loss(remat))(params)))
    assert not checkpointed.search(str(jax.make_jaxpr(loss(model))(params)))
    expected = jax.jit(jax.grad(loss(model)))(params)
    found = jax.jit(jax.grad(loss(remat)))(params)
    for ours, ref in zip(jax.tree.leaves(found), jax.tree.leaves(expected)):
        np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return timm_reference(tmp_path_factory.mktemp("timm"), [PARITY], list(PARAMETERS))


def test_every_size_has_timm_parameter_count_keys_and_shapes(reference):
    for name, count in PARAMETERS.items():
        assert_layout_and_count(name, reference["shapes"][name], count)


def test_logits_match_timm_in_both_directions(reference):
    assert_logits_match(reference["logits"])


def _changed_tokens(shifted: bool, position) -> np.ndarray:
    """(8, 8) map of the tokens that one block's output changes when the input token at
    `position` changes (4x4 windows, shift 2 when `shifted`)."""
    block = swin.SwinBlock(num_heads=2, window_size=4, shifted=shifted)
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 8, 8, 8))
    variables = block.init(jax.random.PRNGKey(1), x, False)
    # A larger relative position bias than its init, so it matters.
    variables = jax.tree_util.tree_map_with_path(
        lambda p, v: v * 50 if "relative_position_bias_table" in str(p) else v, variables
    )
    # Not a constant shift of the channels, which the block's LayerNorm would remove.
    moved = x.at[0, position[0], position[1]].add(jax.random.normal(jax.random.PRNGKey(2), (8,)))
    apply = jax.jit(lambda v, x: block.apply(v, x, False)[0])
    diff = np.abs(np.asarray(apply(variables, moved) - apply(variables, x)))[0].max(-1)
    return diff > 0


def _region(index: int, window: int, shift: int) -> np.ndarray:
    """Which of 8 rows share a region with row `index` when windows start at `shift`
    without wrapping around (Swin's shifted partition)."""
    band = (np.arange(8) + window - shift) // window
    return band == band[index]


@pytest.mark.parametrize("position", [(0, 0), (5, 2), (3, 7), (7, 7)])
def test_windows_block_attention_across_their_borders(position):
    """An unshifted block changes exactly the tokens of the perturbed token's window; a
    shifted one exactly those of its region of the half-window-shifted partition, never
    tokens that the cyclic roll brings next to it from the opposite edge."""
    row, col = position
    window = np.outer(np.arange(8) // 4 == row // 4, np.arange(8) // 4 == col // 4)
    np.testing.assert_array_equal(_changed_tokens(False, position), window)
    region = np.outer(_region(row, 4, 2), _region(col, 4, 2))
    np.testing.assert_array_equal(_changed_tokens(True, position), region)


def test_shifted_window_mask_values_and_small_maps():
    mask = swin.shifted_window_mask((8, 8), (4, 4), (2, 2))
    assert mask.shape == (4, 16, 16)
    assert set(np.unique(mask)) == {0.0, swin.MASKED}
    assert not mask[0].any()  # the first window holds one region only
    assert swin.shifted_window_mask((8, 8), (4, 4), (0, 0)) is None
    # A map no larger than the window is one unshifted window (timm).
    assert swin.window_and_shift((7, 7), 7, True) == ((7, 7), (0, 0))
    assert swin.window_and_shift((14, 14), 7, True) == ((7, 7), (3, 3))


def sown_shapes(model, batch: int = 2, image_size: int = 224):
    """(logits, intermediates) of `model` with attention maps, as shapes (nothing computed)."""
    images = jax.ShapeDtypeStruct((batch, image_size, image_size, 3), jnp.float32)
    variables = jax.eval_shape(
        functools.partial(model.init, train=False), jax.random.PRNGKey(0), images
    )
    logits, state = jax.eval_shape(
        functools.partial(model.apply, train=False, mutable=["intermediates"], sow_attention=True),
        variables,
        images,
    )
    return logits, state["intermediates"]


def test_sows_every_block_per_stage_and_its_window_attention():
    model = models.create("swin_tiny_patch4_window7_224", num_classes=1000)
    logits, sown = sown_shapes(model)
    assert logits.shape == (2, 1000)
    stages = [(2, 56, 96, 3, 64), (2, 28, 192, 6, 16), (6, 14, 384, 12, 4), (2, 7, 768, 24, 1)]
    assert [b.shape for b in sown["block_outputs"]] == [
        (2, side * side, dim) for depth, side, dim, _, _ in stages for _ in range(depth)
    ]
    assert [a.shape for a in sown["attention_maps"]] == [
        (2, heads, windows, 49, 49) for depth, _, _, heads, windows in stages for _ in range(depth)
    ]
    assert model.patch_size == 16  # the RSPC grid: 14x14 at 224, one stage-2 token each


def test_image_sizes_that_timm_would_pad_are_refused():
    model = models.create("swin_tiny_patch4_window7_224", num_classes=10)
    for size, match in ((64, "does not split into 7x7 windows"), (112, "even token map")):
        with pytest.raises(ValueError, match=match):
            models.abstract_variables(model, size)


def test_rspc_train_step_is_finite_and_moves_classifier_and_corruption_model(digits_data_dir):
    before, after, metrics = rspc_train_step(digits_data_dir, "swin_tiny_patch4_window7_224", TINY)
    assert_rspc_step_is_sound(before, after, metrics)


def test_remat_recomputes_the_blocks_with_the_same_gradients():
    one_stage = dict(embed_dim=8, depths=(2,), num_heads=(2,), window_size=2)  # 4x4 tokens
    assert_remat_recomputes_with_the_same_gradients("swin_tiny_patch4_window7_224", one_stage)
