"""One real RSPC train step per model family at smoke size, and the memory/speed options
(`remat`, bfloat16 compute) and the suite's compile flags against the default path through
that same step."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rspc_jax import parallel
from rspc_jax.data import specs as datasets
from rspc_jax.training import setup
from tests.conftest import first_batches, run_python, smoke_config

# Tiny members of each family that run on the 32x32 digits (no PAAS: it needs 224 px).
FAMILIES = {
    "vit": ("vit_tiny", dict(width=32, depth=2, num_heads=2, patch_size=8)),
    "rvt": ("rvt_tiny", dict(base_dims=(8, 8), depth=(1, 1), heads=(2, 4))),
    "fan": (
        "fan_tiny_8_p4_hybrid",
        dict(
            embed_dim=16,
            depth=2,
            num_heads=2,
            stem_depths=(1, 1),
            stem_dims=(8, 16),
            cls_attn_layers=1,
        ),
    ),
    "xcit": ("xcit_nano_12_p16_224", dict(embed_dim=16, depth=2, num_heads=2, cls_attn_layers=1)),
}
COMPARED = ("loss", "ce", "align", "grad_norm", "corruption_grad_norm")


def _config(data_dir, model_name, model_overrides, **config_overrides):
    return smoke_config(
        data_dir,
        model_name=model_name,
        model=dict(model_overrides),
        batch_size=4,
        **{"rspc.rho": 0.25, "model.drop_path_rate": 0.1},
        **config_overrides,
    )


def _parts(config):
    spec = datasets.dataset_spec(config.dataset)
    model = setup.build_model(config, spec.num_classes)
    return setup.build(
        config, model, spec, parallel.create_mesh(), steps_per_epoch=10, total_steps=10
    )


def _one_step_from_a_shared_start(config):
    """fn(variant config) -> (state, metrics) after one step from `config`'s initial state
    on its first digits batch. The options compared here change neither the parameters nor
    the optimizer state, so every variant starts from the same state (copied: the step
    donates it)."""
    mesh = parallel.create_mesh()
    batch = parallel.to_global(
        first_batches(config)[0],
        mesh,
    )
    initial = _parts(config).init(jax.random.PRNGKey(0))

    def one_step(variant):
        state, metrics = _parts(variant).train_step(jax.tree.map(jnp.copy, initial), batch)
        return state, jax.device_get(metrics)

    return one_step


@pytest.mark.parametrize("family", FAMILIES)
def test_rspc_step_remat_and_bfloat16_agree_with_the_default(digits_data_dir, family):
    name, overrides = FAMILIES[family]
    one_step = _one_step_from_a_shared_start(_config(digits_data_dir, name, overrides))

    state, metrics = one_step(_config(digits_data_dir, name, overrides))
    assert all(np.isfinite(metrics[k]) for k in COMPARED)
    assert metrics["align"] > 0 and metrics["corruption_grad_norm"] > 0
    assert metrics["occluded_fraction"] == pytest.approx(0.25)

    remat_state, remat = one_step(_config(digits_data_dir, name, dict(overrides, remat=True)))
    for key in COMPARED:
        np.testing.assert_allclose(remat[key], metrics[key], rtol=1e-5, err_msg=key)
    # Adam's first update is about lr * g / (|g| + eps): float32 rounding in gradients near
    # eps moves a parameter by far less than lr (~1e-4 here), never by a real divergence's lr.
    for ours, ref in zip(jax.tree.leaves(remat_state.params), jax.tree.leaves(state.params)):
        np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5)

    bf16_state, bf16 = one_step(_config(digits_data_dir, name, overrides, compute_dtype="bfloat16"))
    for key in ("loss", "ce", "grad_norm"):
        np.testing.assert_allclose(bf16[key], metrics[key], rtol=5e-2, err_msg=key)
    # Master parameters, optimizer state and BatchNorm statistics stay float32.
    for tree in (bf16_state.params, bf16_state.opt_state, bf16_state.batch_stats):
        assert {
            leaf.dtype for leaf in jax.tree.leaves(tree) if jnp.issubdtype(leaf.dtype, jnp.floating)
        } <= {jnp.dtype(jnp.float32)}


def test_rspc_step_with_scanned_blocks_equals_the_unrolled_step(digits_data_dir):
    """config.scan_blocks runs the same blocks over the same stored parameters, so without
    drop path (whose masks it draws from other keys) one RSPC step gives the same result."""
    name, overrides = FAMILIES["vit"]
    config = _config(digits_data_dir, name, overrides)
    config.model.drop_path_rate = 0.0
    one_step = _one_step_from_a_shared_start(config)
    state, metrics = one_step(config)
    scanned = config.copy_and_resolve_references()
    scanned.scan_blocks = True
    scanned_state, scanned_metrics = one_step(scanned)
    for key in COMPARED:
        np.testing.assert_allclose(scanned_metrics[key], metrics[key], rtol=1e-5, err_msg=key)
    for tree, ref in (
        (scanned_state.params, state.params),
        (scanned_state.corruption_params, state.corruption_params),
    ):
        assert jax.tree.structure(tree) == jax.tree.structure(ref)
        for ours, theirs in zip(jax.tree.leaves(tree), jax.tree.leaves(ref)):
            np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)


def test_scan_blocks_on_a_model_without_it_is_refused(digits_data_dir):
    name, overrides = FAMILIES["rvt"]
    config = _config(digits_data_dir, name, overrides)
    config.scan_blocks = True
    with pytest.raises(ValueError, match="rvt_tiny has no scan_blocks option"):
        setup.build_model(config, 10)


def test_unknown_compute_dtype_is_refused(digits_data_dir):
    config = smoke_config(digits_data_dir, compute_dtype="float16")
    with pytest.raises(ValueError, match="compute_dtype='float16' is not one of"):
        setup.validate_config(config)


def test_patch_aug_official_moves_only_batchnorm_statistics_intended_adds_gradients(
    digits_data_dir,
):
    """RVT's BatchNorm normalises with batch statistics in training, so the official
    (gradient-discarding) patch-wise augmentation changes nothing but the running stats."""
    name, overrides = FAMILIES["rvt"]
    one_step = _one_step_from_a_shared_start(_config(digits_data_dir, name, overrides))
    (off, off_m), (official, official_m), (intended, intended_m) = (
        one_step(_config(digits_data_dir, name, overrides, patch_aug=mode))
        for mode in ("off", "official", "intended")
    )
    for key in COMPARED:
        np.testing.assert_array_equal(official_m[key], off_m[key], err_msg=key)
    assert jax.tree.all(jax.tree.map(np.array_equal, official.params, off.params))
    assert jax.tree.all(
        jax.tree.map(np.array_equal, official.corruption_params, off.corruption_params)
    )
    # Running statistics were updated twice (augmented, then clean batch).
    moved = jax.tree.leaves(
        jax.tree.map(
            lambda a, b: not np.allclose(a, b, atol=1e-7), official.batch_stats, off.batch_stats
        )
    )
    assert all(moved)
    # Intended: the clean-batch loss is the same, the gradient is the sum of both passes.
    np.testing.assert_allclose(intended_m["loss"], off_m["loss"], rtol=1e-6)
    assert not np.isclose(intended_m["grad_norm"], off_m["grad_norm"], rtol=1e-3)


_TWO_STEPS = """
import importlib.util, json, sys
import jax, numpy as np
from rspc_jax import parallel
from rspc_jax.data import specs as datasets
from rspc_jax.training import setup
spec = importlib.util.spec_from_file_location("demo_config", "configs/demo.py")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
config = module.get_config("smoke")
config.data_dir = sys.argv[1]
data = datasets.dataset_spec(config.dataset)
mesh = parallel.create_mesh()
parts = setup.build(config, setup.build_model(config, data.num_classes), data, mesh,
                    steps_per_epoch=10, total_steps=20)
state = parts.init(jax.random.PRNGKey(0))
rng = np.random.default_rng(0)
shape = (config.batch_size, config.image_size, config.image_size, 3)
batch = {"image": rng.standard_normal(shape).astype(np.float32),
         "label": rng.integers(0, data.num_classes, config.batch_size).astype(np.int32)}
for _ in range(2):
    state, metrics = parts.train_step(state, parallel.to_global(batch, mesh))
print(json.dumps({k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}))
"""


def test_the_suites_compile_flags_change_no_result_of_the_rspc_step(digits_data_dir):
    """The suite compiles with conftest.FAST_COMPILE (no LLVM optimisation, XLA:CPU's older
    loop emitters); users' runs compile with XLA's defaults. Two RSPC steps of the demo's
    smoke config give the same metrics both ways, up to float32 rounding."""
    runs = [
        run_python(["-c", _TWO_STEPS, digits_data_dir], env_extra=env, timeout=300)
        for env in (None, {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"})
    ]
    for result in runs:
        assert result.returncode == 0, result.stderr[-3000:]
    suite, default = (json.loads(r.stdout.strip().splitlines()[-1]) for r in runs)
    assert suite.keys() == default.keys() and set(COMPARED) <= suite.keys()
    for key in COMPARED:
        np.testing.assert_allclose(suite[key], default[key], rtol=1e-5, err_msg=key)
