"""Checkpoints: the state round-trips, checkpoints written before the corruption model's
fields were renamed (occ_params, occ_opt_state) still restore, and the checked reader
names the field that does not fit the configured model."""

import flax
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from rspc_jax import models
from rspc_jax.interop import checkpoints
from rspc_jax.training.step import TrainState

META = dict(model_name="vit_demo", dataset="sklearn_digits")


def _state(offset: float) -> TrainState:
    return TrainState(
        step=jnp.asarray(7, jnp.int32),
        params={"dense": {"kernel": jnp.full((3, 2), 1.0 + offset)}},
        batch_stats={},
        opt_state={"mu": jnp.full((3, 2), 2.0 + offset)},
        corruption_params={"fc": {"kernel": jnp.full((4, 4), 3.0 + offset)}},
        corruption_opt_state={"trace": jnp.full((4, 4), 4.0 + offset)},
        ema_params={},
        rng=jax.random.PRNGKey(0),
    )


def _write_legacy(directory: str, state: TrainState) -> None:
    fields = flax.serialization.to_state_dict(state)
    fields["occ_params"] = fields.pop("corruption_params")
    fields["occ_opt_state"] = fields.pop("corruption_opt_state")
    with ocp.CheckpointManager(directory) as manager:
        manager.save(
            7,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(fields), meta=ocp.args.JsonSave(META)
            ),
        )
        manager.wait_until_finished()


def _assert_states_equal(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_checkpoint_with_the_old_field_names_restores(tmp_path):
    directory = str(tmp_path / "checkpoints")
    written = _state(0.5)
    _write_legacy(directory, written)
    checkpointer = checkpoints.Checkpointer(directory, max_to_keep=2)
    restored = checkpointer.restore(7, _state(0.0), META)
    checkpointer.close()
    _assert_states_equal(restored, written)
    step, raw, meta = checkpoints.read_saved_state(directory)
    assert step == 7 and meta == META
    assert "corruption_params" in raw and "occ_params" not in raw
    np.testing.assert_array_equal(raw["corruption_params"]["fc"]["kernel"], np.full((4, 4), 3.5))


def test_the_state_round_trips(tmp_path):
    directory = str(tmp_path / "checkpoints")
    checkpointer = checkpoints.Checkpointer(directory, max_to_keep=2)
    checkpointer.save(3, _state(1.0), META)
    checkpointer.wait_until_finished()
    _assert_states_equal(checkpointer.restore(3, _state(0.0), META), _state(1.0))
    with pytest.raises(checkpoints.CheckpointMismatchError, match="model_name='vit_demo'"):
        checkpointer.restore(3, _state(0.0), dict(META, model_name="deit_small_patch16_224"))
    checkpointer.close()


def test_the_checked_reader_names_the_field_that_differs(tmp_path):
    model = models.create("vit_demo", num_classes=10)
    variables = models.abstract_variables(model, 32)
    params = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), variables["params"])
    state = dict(step=np.int32(1), params=params, batch_stats={}, ema_params={})
    directory = str(tmp_path / "checkpoints")
    with ocp.CheckpointManager(directory) as manager:
        manager.save(
            1,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(META)
            ),
        )
        manager.wait_until_finished()
    step, _, _ = checkpoints.read_model_state(
        directory, None, model=model, model_name="vit_demo", image_size=32
    )
    assert step == 1
    wider = models.create("vit_demo", num_classes=10, width=model.width * 2)
    with pytest.raises(checkpoints.CheckpointMismatchError, match=r"params/.* has shape"):
        checkpoints.read_model_state(
            directory, None, model=wider, model_name="vit_demo", image_size=32
        )
    with pytest.raises(checkpoints.CheckpointMismatchError, match="holds model 'vit_demo'"):
        checkpoints.read_model_state(
            directory, None, model=model, model_name="deit_tiny_patch16_224", image_size=32
        )
