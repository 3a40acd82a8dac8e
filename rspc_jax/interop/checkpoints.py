"""Orbax checkpoints of the whole train state (async, rotated, written by all hosts).

Orbax writes each step into a temporary directory and renames it when complete, so
an interrupted save never replaces or corrupts a finished checkpoint.
"""

import json
from typing import Any

import flax
from flax import traverse_util
import jax
import orbax.checkpoint as ocp
import tensorflow as tf

from rspc_jax import models

# Field names of checkpoints written before the corruption model's fields were renamed.
_LEGACY_NAMES = {"corruption_params": "occ_params", "corruption_opt_state": "occ_opt_state"}


def _current_names(state: dict) -> dict:
    renamed = {old: new for new, old in _LEGACY_NAMES.items()}
    return {renamed.get(name, name): value for name, value in state.items()}


class CheckpointMismatchError(ValueError):
    """A checkpoint does not fit the model/state the current config builds."""


class Checkpointer:
    def __init__(self, directory: str, *, max_to_keep: int):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=True, create=True
        )
        self.directory = directory
        self._manager = ocp.CheckpointManager(directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Starts an async save; the training loop decides when one is due."""
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )

    def restore(self, step: int, like_state: Any, expected_meta: dict) -> Any:
        """Restores into the shapes, dtypes and shardings of `like_state`.

        Raises CheckpointMismatchError naming what differs (model, dataset, a shape).
        """
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
            "meta"
        ]
        for key, value in expected_meta.items():
            if key in meta and meta[key] != value:
                raise CheckpointMismatchError(
                    f"checkpoint {self.directory}/{step} was written with {key}={meta[key]!r}, "
                    f"but the config asks for {key}={value!r}; use another --workdir or "
                    f"restore the original config"
                )
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like_state)
        try:
            restored = self._restore_state(step, abstract)
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointMismatchError(
                f"checkpoint {self.directory}/{step} does not match the state this config "
                f"builds (model {expected_meta.get('model_name')!r}): {e}"
            ) from e
        return restored

    def _restore_state(self, step: int, abstract: Any) -> Any:
        try:
            return self._manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
            )["state"]
        except (ValueError, KeyError, TypeError):
            # A checkpoint written before the corruption model's fields were renamed.
            fields = flax.serialization.to_state_dict(abstract)
            legacy = {_LEGACY_NAMES.get(name, name): value for name, value in fields.items()}
            if legacy.keys() == fields.keys():
                raise
            state = self._manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(legacy))
            )["state"]
            return flax.serialization.from_state_dict(abstract, _current_names(state))

    def wait_until_finished(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()


def read_saved_state(directory: str, step: int | None = None) -> tuple[int, dict, dict]:
    """(step, state as nested dicts of numpy arrays, meta) of a finished checkpoint, without
    building the model or its optimizer (export, evaluation, inspection). `step` None = the
    latest. Each host reads whole arrays onto one local device, so a checkpoint written by
    a pod reads on a single machine and the other way round."""
    if not tf.io.gfile.isdir(directory):
        raise FileNotFoundError(
            f"no checkpoint directory {directory}; pass the --workdir of a training run"
        )
    handlers = dict(state=ocp.StandardCheckpointHandler(), meta=ocp.JsonCheckpointHandler())
    with ocp.CheckpointManager(
        directory, options=ocp.CheckpointManagerOptions(read_only=True), item_handlers=handlers
    ) as manager:
        steps = manager.all_steps()
        if not steps:
            raise FileNotFoundError(f"{directory} holds no finished checkpoint")
        if step is None:
            step = max(steps)
        elif step not in steps:
            raise ValueError(
                f"{directory} has no checkpoint of step {step}; it has {sorted(steps)}"
            )
        # Without a target orbax restores onto the saving run's devices (and refuses any
        # other topology).
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
            manager.item_metadata(step)["state"],
        )
        restored = manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()
            ),
        )
    return step, _current_names(jax.device_get(restored["state"])), restored["meta"]


def read_model_state(
    directory: str, step: int | None, *, model, model_name: str, image_size: int
) -> tuple[int, dict, dict]:
    """`read_saved_state`, checked against the model a config builds: the model name in the
    checkpoint's metadata, then the path and shape of every parameter, BatchNorm statistic
    and EMA parameter. CheckpointMismatchError names the first field that differs."""
    step, state, meta = read_saved_state(directory, step)
    where = f"{directory}/{step}"
    if meta.get("model_name") != model_name:
        raise CheckpointMismatchError(
            f"checkpoint {where} holds model {meta.get('model_name')!r} but the config builds "
            f"{model_name!r}; pass the run's config (config.json in its workdir)"
        )
    expected = models.abstract_variables(model, image_size)
    trees = dict(params=state["params"], batch_stats=state.get("batch_stats") or {})
    if state.get("ema_params"):
        trees["ema_params"] = state["ema_params"]
    for collection, tree in trees.items():
        _check_tree(
            tree,
            expected.get(collection.replace("ema_", ""), {}),
            f"checkpoint {where}",
            collection,
            model_name,
        )
    return step, state, meta


def _check_tree(saved: dict, expected: dict, where: str, collection: str, model_name: str):
    saved = traverse_util.flatten_dict(saved, sep="/")
    expected = traverse_util.flatten_dict(expected, sep="/")
    fix = "pass the run's config (config.json in its workdir) with the same model settings"
    for name in sorted(saved.keys() | expected.keys()):
        if name not in saved:
            raise CheckpointMismatchError(
                f"{where} has no {collection}/{name}, which {model_name} as configured needs; {fix}"
            )
        if name not in expected:
            raise CheckpointMismatchError(
                f"{where} holds {collection}/{name}, which {model_name} as configured does not "
                f"have; {fix}"
            )
        if tuple(saved[name].shape) != tuple(expected[name].shape):
            raise CheckpointMismatchError(
                f"{where}: {collection}/{name} has shape {tuple(saved[name].shape)}, but "
                f"{model_name} as configured needs {tuple(expected[name].shape)}; {fix}"
            )


def write_json(path: str, payload: dict) -> None:
    with tf.io.gfile.GFile(path, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True, default=str)
