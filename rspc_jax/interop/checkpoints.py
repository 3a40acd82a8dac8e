"""Orbax checkpoints of the whole train state (async, rotated, written by all hosts).

Orbax writes each step into a temporary directory and renames it when complete, so
an interrupted save never replaces or corrupts a finished checkpoint.
"""

import json
import logging as std_logging
import os
from typing import Any

from absl import logging
import flax
from flax import traverse_util
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import tensorflow as tf

from rspc_jax import ConfigError, ReportedError, models, resolve_path

# Field names of checkpoints written before the corruption model's fields were renamed.
_LEGACY_NAMES = {"corruption_params": "occ_params", "corruption_opt_state": "occ_opt_state"}


def _current_names(state: dict) -> dict:
    renamed = {old: new for new, old in _LEGACY_NAMES.items()}
    return {renamed.get(name, name): value for name, value in state.items()}


class CheckpointMismatchError(ReportedError, ValueError):
    """A checkpoint does not fit the model/state the current config builds."""


class CheckpointUnreadableError(ReportedError, OSError):
    """A checkpoint's files cannot be read (truncated, garbled, missing)."""


class NoCheckpointError(ReportedError, FileNotFoundError):
    """The workdir or step asked for holds no finished checkpoint."""


class CheckpointSaveError(ReportedError, OSError):
    """Writing a checkpoint failed (disk full, permissions, an unreachable bucket)."""


def _handlers() -> dict:
    return dict(state=ocp.StandardCheckpointHandler(), meta=ocp.JsonCheckpointHandler())


def _restore_as_saved(manager: ocp.CheckpointManager, step: int) -> dict:
    """Step `step`'s state and meta as saved (nested dicts of arrays), whole arrays on this
    host's first device: without a target orbax would restore onto the saving run's devices
    and refuse any other topology."""
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
        manager.item_metadata(step)["state"],
    )
    return manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()
        ),
    )


def _cause(error: BaseException) -> str:
    """The first sentence of an error (tensorstore and orbax errors run to many lines and
    append whole TensorStore specs)."""
    lines = str(error).strip().splitlines()
    first = lines[0].split(" See full TensorStore details")[0] if lines else ""
    return f"{type(error).__name__}: {first}"


class _OrbaxErrors(std_logging.Handler):
    """Keeps the last exception orbax logged: a failed async save is logged by orbax's
    finalize thread and then only surfaces as a missing step, without its cause."""

    def __init__(self):
        super().__init__(std_logging.ERROR)
        self.last: BaseException | None = None

    def emit(self, record) -> None:
        if "orbax" in record.pathname and record.exc_info and record.exc_info[1]:
            self.last = record.exc_info[1]


_UNFINISHED = ".orbax-checkpoint-tmp"  # orbax's name for a step it is still writing


def _remove_unfinished_saves(directory: str) -> None:
    """Deletes the temporary folders of saves that never finished (a kill, a full disk).
    Orbax never lists them as steps, but a new save of the same step would meet them. Done
    here, synchronously, rather than by orbax's `cleanup_tmp_directories`, whose background
    listing can race the directory's creation."""
    if jax.process_index() != 0:
        return
    for name in tf.io.gfile.listdir(directory):
        if _UNFINISHED in name:
            tf.io.gfile.rmtree(os.path.join(directory, name.rstrip("/")))


class Checkpointer:
    """Async, rotated orbax checkpoints of the train state with two guarantees: a failed save
    stops training (CheckpointSaveError, raised by the next `check` or `save`) instead of
    failing silently in orbax's background thread, and `restore_latest` skips a checkpoint
    that cannot be read, moving it aside, rather than dying on it."""

    def __init__(self, directory: str, *, max_to_keep: int):
        directory = resolve_path(directory)  # orbax refuses a relative path
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=True,
            create=True,
        )
        self.directory = directory
        tf.io.gfile.makedirs(directory)
        _remove_unfinished_saves(directory)
        self._manager = ocp.CheckpointManager(directory, options=options, item_handlers=_handlers())
        self._in_flight: int | None = None
        self._orbax_errors = _OrbaxErrors()
        std_logging.getLogger("absl").addHandler(self._orbax_errors)

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Starts an async save; the training loop decides when one is due. Orbax waits for
        the previous save first, so that one is checked here (a failure names its own step)."""
        self.check()
        try:
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
                ),
                force=True,
            )
        except Exception as error:
            raise self._save_error(step, error) from error
        self._in_flight = step

    def check(self, wait: bool = True) -> None:
        """Raises CheckpointSaveError if the last save failed; without `wait` only once it
        has ended (a cheap poll for every train step)."""
        step = self._in_flight
        if step is None or (not wait and self._manager.is_saving_in_progress()):
            return
        self._in_flight = None
        try:
            self._manager.wait_until_finished()
            self._manager.check_for_errors()
        except Exception as error:
            raise self._save_error(step, error) from error
        self._manager.reload()
        if step not in self._manager.all_steps():  # orbax logs a failed item and skips it
            raise self._save_error(step, None)

    def _save_error(self, step: int, error: BaseException | None) -> CheckpointSaveError:
        kept = sorted(s for s in self._manager.all_steps() if s != step)
        error = error or self._orbax_errors.last
        cause = _cause(error) if error else "orbax did not finalise it"
        return CheckpointSaveError(
            f"saving checkpoint {self.directory}/{step} failed ({cause}); training stopped. "
            f"The earlier checkpoints ({kept or 'none'}) are intact. Fix the cause "
            "(free disk space, permissions, the bucket's reachability) and rerun the same command "
            "to resume from the last one."
        )

    def restore(self, step: int, like_state: Any, expected_meta: dict) -> Any:
        """Restores into the shapes, dtypes and shardings of `like_state`.

        Raises CheckpointMismatchError naming what differs (model, dataset, a shape), and
        CheckpointUnreadableError when the checkpoint's files cannot be read.
        """
        where = f"{self.directory}/{step}"
        try:
            meta = self._manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )["meta"]
        except Exception as error:
            raise CheckpointUnreadableError(f"{where}: {_cause(error)}") from error
        for key, value in expected_meta.items():
            if key in meta and meta[key] != value:
                raise CheckpointMismatchError(
                    f"checkpoint {where} was written with {key}={meta[key]!r}, "
                    f"but the config asks for {key}={value!r}; use another --workdir or "
                    f"restore the original config"
                )
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like_state)
        try:
            return self._restore_state(step, abstract)
        except Exception as error:
            # Readable on its own terms: the config builds another state. Else: damaged.
            try:
                _restore_as_saved(self._manager, step)
            except Exception as read_error:
                raise CheckpointUnreadableError(f"{where}: {_cause(read_error)}") from error
            raise CheckpointMismatchError(
                f"checkpoint {where} does not match the state this config "
                f"builds (model {expected_meta.get('model_name')!r}): {_cause(error)}"
            ) from error

    def restore_latest(self, like_state: Any, expected_meta: dict) -> tuple[int, Any] | None:
        """(step, state) of the newest checkpoint that can be read, or None if there is none.

        An unreadable newer checkpoint is moved to <directory>.unreadable/<step> (never
        deleted) with a warning saying why; a mismatch stops with CheckpointMismatchError. If
        none can be read, raises CheckpointUnreadableError and moves nothing."""
        problems = {}
        for step in sorted(self._manager.all_steps(), reverse=True):
            try:
                state = self.restore(step, like_state, expected_meta)
            except CheckpointUnreadableError as error:
                problems[step] = error
                continue
            for bad_step, error in problems.items():
                self._set_aside(bad_step, error, resumed_step=step)
            return step, state
        if problems:
            raise CheckpointUnreadableError(
                f"no checkpoint in {self.directory} can be read: "
                + "; ".join(str(e) for e in problems.values())
                + ". Nothing was moved; restore them from a copy, or move them away to start over."
            )
        return None

    def _set_aside(self, step: int, error: Exception, resumed_step: int) -> None:
        """Moves an unreadable step out of orbax's sight, keeping its files for inspection."""
        aside = f"{self.directory}.unreadable"
        target = f"{aside}/{step}"
        if jax.process_index() == 0:
            tf.io.gfile.makedirs(aside)
            suffix = 1
            while tf.io.gfile.exists(target):
                target, suffix = f"{aside}/{step}.{suffix}", suffix + 1
            tf.io.gfile.rename(f"{self.directory}/{step}", target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"rspc_jax set aside checkpoint {step}")
        self._manager.reload()
        logging.warning(
            f"checkpoint {self.directory}/{step} cannot be read ({error}); resuming from step "
            f"{resumed_step} instead. Its files were moved to {target}."
        )

    def _restore_state(self, step: int, abstract: Any) -> Any:
        try:
            return self._manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
            )["state"]
        except (ValueError, KeyError, TypeError):
            # A checkpoint of an older layout: the corruption model's fields under their old
            # names, or no EMA of the BatchNorm statistics (which then restarts from the
            # live statistics, as a fresh run's does).
            fields = flax.serialization.to_state_dict(abstract)
            saved = self._manager.item_metadata(step)["state"].keys()
            legacy = {_LEGACY_NAMES.get(name, name): value for name, value in fields.items()}
            missing_ema = "ema_batch_stats" not in saved and jax.tree.leaves(
                fields.get("ema_batch_stats", {})
            )
            if missing_ema:
                del legacy["ema_batch_stats"]
            if legacy.keys() == fields.keys():
                raise
            state = _current_names(
                self._manager.restore(
                    step, args=ocp.args.Composite(state=ocp.args.StandardRestore(legacy))
                )["state"]
            )
            if missing_ema:
                logging.warning(
                    f"checkpoint {self.directory}/{step} has no EMA of the BatchNorm "
                    "statistics (written before config.ema_batch_stats): it starts from the "
                    "current statistics"
                )
                state["ema_batch_stats"] = jax.tree.map(jnp.copy, state["batch_stats"])
            return flax.serialization.from_state_dict(abstract, state)

    def wait_until_finished(self) -> None:
        """Waits for the save in flight; raises CheckpointSaveError if it failed."""
        self.check(wait=True)

    def close(self) -> None:
        """Waits for the save in flight (raising if it failed) and releases orbax's threads."""
        try:
            self.check(wait=True)
        finally:
            self._manager.close()
            std_logging.getLogger("absl").removeHandler(self._orbax_errors)


def read_saved_state(directory: str, step: int | None = None) -> tuple[int, dict, dict]:
    """(step, state as nested dicts of numpy arrays, meta) of a finished checkpoint, without
    building the model or its optimizer (export, evaluation, inspection). `step` None = the
    latest. Each host reads whole arrays onto one local device, so a checkpoint written by
    a pod reads on a single machine and the other way round."""
    directory = resolve_path(directory)  # orbax refuses a relative path
    if not tf.io.gfile.isdir(directory):
        raise NoCheckpointError(
            f"no checkpoint directory {directory}; pass the --workdir of a training run"
        )
    with ocp.CheckpointManager(
        directory, options=ocp.CheckpointManagerOptions(read_only=True), item_handlers=_handlers()
    ) as manager:
        steps = manager.all_steps()
        if not steps:
            raise NoCheckpointError(f"{directory} holds no finished checkpoint")
        if step is None:
            step = max(steps)
        elif step not in steps:
            raise ConfigError(
                f"{directory} has no checkpoint of step {step}; it has {sorted(steps)}"
            )
        restored = _restore_as_saved(manager, step)
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
    for collection in ("ema_params", "ema_batch_stats"):
        if state.get(collection):
            trees[collection] = state[collection]
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


def latest_step(checkpoints: str) -> int | None:
    """The newest finished checkpoint step in the folder `checkpoints`, None before the first
    (orbax's unfinished saves are not steps)."""
    steps = tf.io.gfile.listdir(checkpoints) if tf.io.gfile.isdir(checkpoints) else []
    return max((int(s.strip("/")) for s in steps if s.strip("/").isdigit()), default=None)


def write_json(path: str, payload: dict) -> None:
    with tf.io.gfile.GFile(path, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True, default=str)
