"""Orbax checkpoints of the whole train state (async, rotated, written by all hosts).

Orbax writes each step into a temporary directory and renames it when complete, so
an interrupted save never replaces or corrupts a finished checkpoint.
"""

import json
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp
import tensorflow as tf


class CheckpointMismatchError(ValueError):
    """A checkpoint does not fit the model/state the current config builds."""


class Checkpointer:

    def __init__(self, directory: str, *, max_to_keep: int):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=True, create=True)
        self.directory = directory
        self._manager = ocp.CheckpointManager(directory, options=options)

    def latest_step(self) -> Optional[int]:
        return self._manager.latest_step()

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Starts an async save; the training loop decides when one is due."""
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)

    def restore(self, step: int, like_state: Any, expected_meta: dict) -> Any:
        """Restores into the shapes, dtypes and shardings of `like_state`.

        Raises CheckpointMismatchError naming what differs (model, dataset, a shape).
        """
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        for key, value in expected_meta.items():
            if key in meta and meta[key] != value:
                raise CheckpointMismatchError(
                    f"checkpoint {self.directory}/{step} was written with {key}={meta[key]!r}, "
                    f"but the config asks for {key}={value!r}; use another --workdir or "
                    f"restore the original config")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like_state)
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointMismatchError(
                f"checkpoint {self.directory}/{step} does not match the state this config "
                f"builds (model {expected_meta.get('model_name')!r}): {e}") from e
        return restored["state"]

    def wait_until_finished(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()


def read_saved_state(directory: str, step: Optional[int] = None) -> tuple[int, dict, dict]:
    """(step, state as nested dicts of numpy arrays, meta) of a finished checkpoint, without
    building the model or its optimizer (export, evaluation, inspection). `step` None = the
    latest. Each host reads whole arrays onto one local device, so a checkpoint written by
    a pod reads on a single machine and the other way round."""
    if not tf.io.gfile.isdir(directory):
        raise FileNotFoundError(f"no checkpoint directory {directory}; pass the --workdir of a "
                                "training run")
    handlers = dict(state=ocp.StandardCheckpointHandler(), meta=ocp.JsonCheckpointHandler())
    with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True),
                               item_handlers=handlers) as manager:
        steps = manager.all_steps()
        if not steps:
            raise FileNotFoundError(f"{directory} holds no finished checkpoint")
        if step is None:
            step = max(steps)
        elif step not in steps:
            raise ValueError(f"{directory} has no checkpoint of step {step}; it has {sorted(steps)}")
        # Without a target orbax restores onto the saving run's devices (and refuses any
        # other topology).
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                              manager.item_metadata(step)["state"])
        restored = manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
    return step, jax.device_get(restored["state"]), restored["meta"]


def write_json(path: str, payload: dict) -> None:
    with tf.io.gfile.GFile(path, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True, default=str)
