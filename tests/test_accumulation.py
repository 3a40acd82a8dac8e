"""Gradient accumulation (config.grad_accum_steps) and the EMA of BatchNorm statistics
(config.ema_batch_stats): k micro-batches make the update of one batch, BatchNorm sees each
micro-batch, and the EMA averages the statistics as timm's ModelEmaV2 does."""

import functools
import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rspc_jax import ConfigError, parallel
from rspc_jax.data import specs as datasets
from rspc_jax.interop import checkpoints as checkpointing
from rspc_jax.interop import export, state_dicts
from rspc_jax.training import checks, defaults, setup
from tests.conftest import first_batches, run_python, smoke_config

RVT = dict(model_name="rvt_tiny", model=dict(base_dims=(8, 8), depth=(1, 1), heads=(2, 4)))


def _train(config, batches):
    """(initial state, final state, metrics of each step) of `config` on `batches`."""
    spec = datasets.dataset_spec(config.dataset)
    mesh = parallel.create_mesh()
    parts = setup.build(
        config,
        setup.build_model(config, spec.num_classes),
        spec,
        mesh,
        steps_per_epoch=10,
        total_steps=10,
    )
    state = parts.init(jax.random.PRNGKey(0))
    initial = jax.device_get(state)
    history = []
    for batch in batches:
        state, metrics = parts.train_step(state, parallel.to_global(batch, mesh))
        history.append(jax.device_get(metrics))
    return initial, jax.device_get(state), history


def _assert_close(a, b, atol, what):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, atol=atol, rtol=0, err_msg=what)


@pytest.mark.parametrize("rspc", [False, True], ids=["plain", "rspc"])
def test_micro_batches_make_the_update_of_one_batch(digits_data_dir, rspc):
    """BatchNorm-free ViT, drop path off (its masks are drawn per micro-batch): two Adam
    steps with k = 1, 2, 4 micro-batches agree, the corruption model's ascent too."""
    make = functools.partial(
        smoke_config,
        digits_data_dir,
        batch_size=8,
        **{"rspc.enabled": rspc, "model.drop_path_rate": 0.0},
    )
    batches = first_batches(make(), 2)
    _, reference, reference_metrics = _train(make(grad_accum_steps=1), batches)
    for k in (2, 4):
        _, state, metrics = _train(make(grad_accum_steps=k), batches)
        for name in ("params", "opt_state", "corruption_params", "corruption_opt_state"):
            _assert_close(getattr(state, name), getattr(reference, name), 1e-5, f"{name}, k={k}")
        for key in ("loss", "ce", "grad_norm", "train_accuracy") + ("align",) * rspc:
            np.testing.assert_allclose(
                metrics[-1][key], reference_metrics[-1][key], rtol=1e-5, err_msg=key
            )
        if rspc:  # C actually moved, so its equality is not trivial
            assert metrics[-1]["corruption_grad_norm"] > 0


def test_with_batchnorm_micro_batches_differ_only_by_their_statistics(digits_data_dir):
    """RVT (BatchNorm in its conv MLP), plain step, a batch that is 4 images twice: each
    micro-batch of k = 2 has the whole batch's statistics, so the update is the one-batch
    update, and the running averages have moved twice with momentum 0.1 instead of once."""
    make = functools.partial(
        smoke_config, digits_data_dir, batch_size=8, **RVT, **{"rspc.enabled": False}
    )
    half = first_batches(make(batch_size=4), 1)[0]
    twice = {key: np.concatenate([value, value]) for key, value in half.items()}
    initial, one, _ = _train(make(grad_accum_steps=1), [twice])
    _, two, _ = _train(make(grad_accum_steps=2), [twice])
    _assert_close(two.params, one.params, 1e-5, "params")
    assert jax.tree.leaves(initial.batch_stats), "the model has no BatchNorm"

    def moved_twice(start, once):  # r1 = 0.9 r0 + 0.1 s  ->  r2 = 0.81 r0 + 0.19 s
        return 0.81 * start + 0.19 * (once - 0.9 * start) / 0.1

    expected = jax.tree.map(moved_twice, initial.batch_stats, one.batch_stats)
    _assert_close(two.batch_stats, expected, 1e-4, "running statistics")
    # ... which is not what one update would give.
    assert not np.allclose(
        jax.tree.leaves(two.batch_stats)[0], jax.tree.leaves(one.batch_stats)[0], atol=1e-4
    )


def test_ema_of_batchnorm_statistics_follows_the_decay(digits_data_dir):
    make = functools.partial(smoke_config, digits_data_dir, batch_size=4, ema_decay=0.9, **RVT)
    batches = first_batches(make(), 2)
    initial, state, _ = _train(make(), batches[:1])
    expected = jax.tree.map(lambda e, s: 0.9 * e + 0.1 * s, initial.batch_stats, state.batch_stats)
    _assert_close(state.ema_batch_stats, expected, 1e-6, "EMA of the statistics")
    _assert_close(
        state.ema_params,
        jax.tree.map(lambda e, p: 0.9 * e + 0.1 * p, initial.params, state.params),
        1e-6,
        "EMA of the parameters",
    )
    _, off, _ = _train(make(ema_batch_stats=False), batches[:1])
    assert off.ema_batch_stats == {} and jax.tree.leaves(off.ema_params)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(grad_accum_steps=0), "grad_accum_steps=0 is out of range"),
        (dict(grad_accum_steps=3), "batch_size=8 is not divisible by config.grad_accum_steps=3"),
    ],
)
def test_bad_accumulation_settings_fail_before_anything_is_built(overrides, match):
    config = smoke_config("", batch_size=8, **overrides)
    with pytest.raises(ConfigError, match=match):
        checks.validate_config(config)


def test_a_checkpoint_without_the_ema_of_the_statistics_resumes(tmp_path):
    """Runs saved before config.ema_batch_stats existed: their EMA restarts its statistics
    from the live ones, with a warning, instead of refusing to resume."""
    state = dict(
        step=np.int32(3),
        params=dict(w=np.ones((2, 2), np.float32)),
        batch_stats=dict(mean=np.full((2,), 0.5, np.float32)),
        ema_params=dict(w=np.zeros((2, 2), np.float32)),
    )
    ckpt = checkpointing.Checkpointer(str(tmp_path / "checkpoints"), max_to_keep=1)
    ckpt.save(3, state, dict(model_name="m"))
    ckpt.close()
    like = jax.tree.map(jnp.asarray, dict(state, ema_batch_stats=dict(mean=np.zeros((2,)))))
    step, restored = checkpointing.Checkpointer(
        str(tmp_path / "checkpoints"), max_to_keep=1
    ).restore_latest(like, dict(model_name="m"))
    assert step == 3
    np.testing.assert_array_equal(restored["ema_batch_stats"]["mean"], [0.5, 0.5])
    np.testing.assert_array_equal(restored["ema_params"]["w"], np.zeros((2, 2)))


@pytest.mark.skipif(
    importlib.util.find_spec("timm") is None,
    reason="timm is not installed (requirements-torch.txt)",
)
def test_exported_ema_carries_the_averaged_statistics_and_loads_in_timm_strictly(tmp_path):
    name = "xcit_nano_12_p16_224"
    sizes = dict(embed_dim=16, depth=1, num_heads=2, cls_attn_layers=1)
    config = defaults.get_default_config()
    config.model_name, config.model, config.image_size = name, sizes, 32
    config.ema_decay = 0.99
    model = setup.build_model(config, 10)
    abstract = jax.eval_shape(
        functools.partial(model.init, train=False),
        jax.random.PRNGKey(0),
        jax.ShapeDtypeStruct((1, 32, 32, 3), jnp.float32),
    )
    rng = np.random.default_rng(0)
    draw = lambda leaf: rng.random(leaf.shape, np.float32) + 0.5  # noqa: E731
    state = {
        key: jax.tree.map(draw, abstract[key.replace("ema_", "")])
        for key in ("params", "batch_stats", "ema_params", "ema_batch_stats")
    }
    state["step"] = np.int32(5)
    workdir = tmp_path / "run"
    ckpt = checkpointing.Checkpointer(str(workdir / "checkpoints"), max_to_keep=1)
    ckpt.save(5, state, dict(model_name=name))
    ckpt.close()
    checkpointing.write_json(str(workdir / "config.json"), config.to_dict())

    out = str(tmp_path / "ema.pth")
    export.export(str(workdir), out, ema=True)
    # timm in its own process (torch and TensorFlow in one process can crash).
    script = (
        "import json, sys, timm, torch, numpy as np\n"
        "model = timm.create_model(sys.argv[1], pretrained=False, num_classes=10, img_size=32,"
        " **json.loads(sys.argv[2]))\n"
        "state = torch.load(sys.argv[3], weights_only=True)\n"
        "model.load_state_dict(state, strict=True)\n"
        "np.savez(sys.argv[4], **{k: v.numpy() for k, v in state.items()})\n"
    )
    loaded = str(tmp_path / "loaded.npz")
    result = run_python(["-c", script, name, json.dumps(sizes), out, loaded])
    assert result.returncode == 0, result.stderr[-3000:]
    exported = dict(np.load(loaded))
    # The running statistics are the averaged ones (every leaf was drawn apart).
    expected = state_dicts.export_state_dict(
        dict(params=state["ema_params"], batch_stats=state["ema_batch_stats"])
    )
    assert any(key.endswith("running_var") for key in exported)
    assert exported.keys() == expected.keys()
    for key, value in exported.items():
        np.testing.assert_array_equal(value, expected[key], err_msg=key)
