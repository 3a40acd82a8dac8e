"""`python -m rspc_jax.export` on real runs, the official RVT/FAN container, and
`config.init_from` starting a run from an exported checkpoint."""

import functools
import importlib.util
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rspc_jax.interop import checkpoints as checkpointing
from rspc_jax.interop import export
from rspc_jax.interop import state_dicts as interop
from rspc_jax.training import defaults as config_defaults
from rspc_jax.training import loop as train
from rspc_jax.training import setup
from tests.conftest import assert_trees_equal, run_python, smoke_config, torch_keys_manifest

needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None,
    reason="torch is not installed (requirements-torch.txt)",
)


def _like(state, params_key="params"):
    return dict(
        params=state[params_key],
        **({"batch_stats": state["batch_stats"]} if state.get("batch_stats") else {}),
    )


@needs_torch
def test_cli_exports_ema_weights_and_the_corruption_model(demo_run, tmp_path):
    workdir, _ = demo_run
    out, corruption = tmp_path / "vit.pth", tmp_path / "occlusion.pth.tar"
    result = run_python(
        [
            "-m",
            "rspc_jax.export",
            f"--workdir={workdir}",
            "--ema",
            f"--out={out}",
            f"--corruption_out={corruption}",
        ],
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Exported vit_demo step 6 (EMA weights" in result.stdout
    step, state, _ = checkpointing.read_saved_state(str(workdir / "checkpoints"))
    assert step == 6
    assert_trees_equal(interop.load_checkpoint(str(out), _like(state)), _like(state, "ema_params"))
    corruption_state = interop.read_state_dict(str(corruption))
    assert {k: v.shape for k, v in corruption_state.items()} == {
        "patch_embed.weight": (1, 3, 8, 8),
        "fc.weight": (16, 16),
    }
    np.testing.assert_array_equal(
        corruption_state["fc.weight"], state["corruption_params"]["fc"]["kernel"].T
    )
    np.testing.assert_array_equal(
        corruption_state["patch_embed.weight"],
        state["corruption_params"]["patch_embed"]["kernel"].transpose(3, 2, 0, 1),
    )


def test_safetensors_export_needs_no_torch_and_an_older_step_can_be_picked(demo_run, tmp_path):
    workdir, _ = demo_run
    out = str(tmp_path / "vit.safetensors")
    summary = export.export(str(workdir), out, step=3)
    assert "step 3 (raw weights" in summary
    _, state, _ = checkpointing.read_saved_state(str(workdir / "checkpoints"), 3)
    assert_trees_equal(interop.load_checkpoint(out, _like(state)), _like(state))
    with pytest.raises(ValueError, match=r"no checkpoint of step 4; it has \[3, 6\]"):
        export.export(str(workdir), out, step=4)


def _synthetic_run(tmp_path, name: str, ema: bool):
    """A workdir holding a checkpoint of full-size `name` (random weights, no training)."""
    config = config_defaults.get_default_config()
    config.model_name, config.dataset, config.image_size = name, "imagenet2012", 224
    config.ema_decay = 0.999 if ema else 0.0
    model = setup.build_model(config, 1000)
    abstract = jax.eval_shape(
        functools.partial(model.init, train=False),
        jax.random.PRNGKey(0),
        jax.ShapeDtypeStruct((1, 224, 224, 3), jnp.float32),
    )
    rng = np.random.default_rng(0)
    draw = lambda leaf: rng.random(leaf.shape, np.float32)  # noqa: E731
    state = dict(
        step=np.int32(7),
        params=jax.tree.map(draw, abstract["params"]),
        batch_stats=jax.tree.map(draw, abstract["batch_stats"]),
    )
    if ema:
        state["ema_params"] = jax.tree.map(draw, abstract["params"])
    workdir = tmp_path / name
    ckpt = checkpointing.Checkpointer(str(workdir / "checkpoints"), max_to_keep=1)
    ckpt.save(7, state, dict(model_name=name))
    ckpt.wait_until_finished()
    ckpt.close()
    checkpointing.write_json(str(workdir / "config.json"), config.to_dict())
    return workdir, state


@needs_torch
@pytest.mark.parametrize("name,ema", [("rvt_tiny_plus", True), ("fan_tiny_8_p4_hybrid", False)])
def test_rvt_and_fan_export_the_official_container_with_the_official_keys(tmp_path, name, ema):
    import torch

    workdir, state = _synthetic_run(tmp_path, name, ema)
    out = str(tmp_path / f"{name}.pth.tar")
    export.export(str(workdir), out)
    checkpoint = torch.load(out, weights_only=True)
    assert set(checkpoint) == {"state_dict", "arch"} | ({"state_dict_ema"} if ema else set())
    assert checkpoint["arch"] == name
    manifest = {key: tuple(shape) for key, shape, _ in torch_keys_manifest(name)["entries"]}
    for entry in ("state_dict", "state_dict_ema") if ema else ("state_dict",):
        assert {k: tuple(v.shape) for k, v in checkpoint[entry].items()} == manifest
    assert_trees_equal(interop.load_checkpoint(out, _like(state)), _like(state))
    if ema:
        assert_trees_equal(
            interop.load_checkpoint(out, _like(state), ema=True), _like(state, "ema_params")
        )


def test_export_refuses_ema_when_the_run_kept_none(tmp_path):
    workdir, _ = _synthetic_run(tmp_path, "fan_tiny_8_p4_hybrid", ema=False)
    with pytest.raises(ValueError, match="kept no EMA"):
        export.export(str(workdir), str(tmp_path / "x.safetensors"), ema=True)


@pytest.mark.parametrize("out,corruption_out", [("vit.pth", None), ("vit.safetensors", "c.pth")])
def test_a_torch_file_without_torch_is_refused_with_the_fix_before_the_run_is_read(
    tmp_path, monkeypatch, out, corruption_out
):
    """The message names requirements-torch.txt and .safetensors, and comes before anything
    is read (the workdir here does not even exist); the CLI prints it without a traceback."""
    from rspc_jax import ReportedError

    monkeypatch.setitem(__import__("sys").modules, "torch", None)  # import torch fails
    with pytest.raises(ReportedError, match="requirements-torch.txt.*safetensors"):
        export.export(
            str(tmp_path / "no_run"),
            str(tmp_path / out),
            corruption_out=corruption_out and str(tmp_path / corruption_out),
        )


def test_a_workdir_that_is_no_run_is_refused_with_the_fix(tmp_path):
    from rspc_jax import ReportedError

    with pytest.raises(ReportedError, match="is not a training run.*rspc_jax.main"):
        export.export(str(tmp_path / "no_run"), str(tmp_path / "vit.safetensors"))


def test_init_from_starts_training_at_the_checkpoint(demo_run, digits_data_dir, tmp_path, caplog):
    workdir, _ = demo_run
    start = str(tmp_path / "start.safetensors")
    export.export(str(workdir), start)
    _, saved, _ = checkpointing.read_saved_state(str(workdir / "checkpoints"))
    # An lr far below float32's resolution (0 is refused): one step leaves the params where
    # the checkpoint put them.
    config = smoke_config(
        digits_data_dir,
        **{
            "init_from": start,
            "total_steps": 1,
            "optimizer.lr": 1e-30,
            "optimizer.warmup_lr": 0.0,
            "optimizer.min_lr": 0.0,
        },
    )
    with caplog.at_level(logging.INFO):
        result = train.train_and_evaluate(config, str(tmp_path / "finetune"))
    assert f"Initialised from {start}" in caplog.text
    assert_trees_equal(jax.device_get(result["state"].params), saved["params"])
