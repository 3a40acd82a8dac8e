"""The training loop: config -> state -> steps, evaluation, metrics, checkpoints, resume."""

from collections.abc import Callable, Iterator
import contextlib
import dataclasses
import json
import os
import re
import signal
import threading
from typing import NamedTuple
import uuid

from absl import logging
from clu import parameter_overview
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tensorflow as tf

from rspc_jax import ConfigError, ReportedError, models, parallel, resolve_path
from rspc_jax.data import records
from rspc_jax.data import specs as datasets
from rspc_jax.data import train as train_data
from rspc_jax.evaluation import run_suites
from rspc_jax.evaluation.suites import clean as clean_suite
from rspc_jax.interop import checkpoints as checkpointing
from rspc_jax.interop import run_record
from rspc_jax.interop import state_dicts as interop
from rspc_jax.training import host_memory, memory_check, setup, workdir_lock
from rspc_jax.training import reporting as metrics_lib
from rspc_jax.training import step as train_step_lib


class DamagedDataError(ReportedError, OSError):
    """A record file of the dataset cannot be read to its end (cut short, garbled, gone)."""


def resolve_workdir(workdir: str) -> str:
    """Creates `workdir` and writes a test file into it, so that a bucket that cannot be
    reached or written fails here, before anything compiles, with its likely causes; local
    paths become absolute (`rspc_jax.resolve_path`: orbax needs that), gs:// stays."""
    workdir = resolve_path(workdir)
    probe = os.path.join(workdir, f".write-test-{uuid.uuid4().hex}")
    try:
        tf.io.gfile.makedirs(workdir)
        with tf.io.gfile.GFile(probe, "w") as f:
            f.write("ok")
        tf.io.gfile.remove(probe)
    except tf.errors.OpError as error:
        raise _unwritable_workdir(workdir, error) from None
    return workdir


def _unwritable_workdir(workdir: str, error: tf.errors.OpError) -> ConfigError:
    """The paragraph of a workdir that cannot be created or written; for a bucket, its
    likely causes and how to check each."""
    cause = f"{type(error).__name__}: {error.message.splitlines()[0] if error.message else ''}"
    if "://" not in workdir:
        return ConfigError(
            f"cannot write into --workdir {workdir} ({cause}). Pass a directory you can write "
            "to (or fix its permissions / free disk space)."
        )
    scheme, rest = workdir.split("://", 1)
    bucket = f"{scheme}://{rest.split('/')[0]}"
    return ConfigError(
        f"cannot write into --workdir {workdir} ({cause}). The likely causes, and how to "
        f"check each from this machine: no credentials (`gcloud auth list`; on a VM, its "
        f"service account and access scopes), no network route to the storage service "
        f"(`gsutil ls {bucket}`; a VM without an external IP needs Private Google Access), "
        f"or no permission to write into the bucket, or no such bucket (`gsutil iam get "
        f"{bucket}`, or `echo ok | gsutil cp - {workdir}/probe`). Fix the cause, or pass a "
        "local --workdir, and rerun."
    )


def _record_file(message: str) -> str | None:
    """The data file an error of tf.data names, if any (a truncated record does not)."""
    found = re.search(r"\S*\.(?:tfrecord|array_record)\S*", message)
    return found.group(0).rstrip(";:,'\"") if found else None


def _resume_point(checkpoints: str) -> str:
    """Which checkpoint in the folder `checkpoints` a rerun resumes from, as a sentence."""
    last = checkpointing.latest_step(checkpoints)
    if last is None:
        return "No checkpoint was written yet"
    return f"The checkpoint of step {last} in {checkpoints} is intact and stays the resume point"


def _unreadable_record_file(folder: str, split: str) -> str | None:
    """The first record file in `folder` that tf.data cannot read to its end, those of
    `split` first: TensorFlow does not name the file of a truncated record."""
    files = sorted(
        tf.io.gfile.glob(os.path.join(folder, "*.tfrecord*")),
        key=lambda path: f"-{split}." not in os.path.basename(path),
    )
    for path in files:
        try:
            tf.data.TFRecordDataset(path).reduce(0, lambda count, _: count + 1)
        except tf.errors.OpError:
            return path
    return None


def _damaged_data(config, workdir: str, error: tf.errors.OpError) -> DamagedDataError:
    """The paragraph of a dataset whose record file cannot be read: which dataset and file
    (the one TensorFlow names, else the first that does not read to its end), what is
    wrong, how to rebuild it, and where the run resumes."""
    message = error.message.split(" [Op:")[0].split("}} ")[-1]
    builder = records.get_builder(config.dataset, config.data_dir)
    folder = builder.data_dir  # <data_dir>/<name>[/<config>]/<version>
    data_dir = folder.split(os.sep + builder.name + os.sep)[0]
    path = _record_file(message) or _unreadable_record_file(folder, config.train_split or "train")
    which = path or f"a record file in {folder} (each reads to its end now)"
    resume = _resume_point(os.path.join(workdir, "checkpoints"))
    return DamagedDataError(
        f"dataset {config.dataset!r} is damaged: {which} cannot be read ({message}); it is "
        "shorter than its records say, garbled or gone, e.g. a copy cut off. Rebuild the "
        f"dataset with `tfds build {config.dataset} --data_dir={data_dir}` (or delete "
        f"{folder} for a dataset this project builds from a package, such as the digits, and "
        "the next run rebuilds it), or restore the file from an intact copy. "
        f"{resume}; rerun the same command to resume."
    )


class BestKeeper:
    """Early stopping as the thesis does it: the state of the best eval by
    `config.keep_best` goes to <workdir>/best, itself a workdir (config.json +
    checkpoints/<step>) that evaluate and export read with --workdir=<workdir>/best."""

    def __init__(self, workdir: str, config, meta: dict):
        self.directory = os.path.join(workdir, "best")
        self.metric = config.keep_best
        self._meta = meta
        self._ckpt = checkpointing.Checkpointer(
            os.path.join(self.directory, "checkpoints"), max_to_keep=1
        )
        self._record = os.path.join(self.directory, "best.json")
        self.value = -float("inf")
        if tf.io.gfile.exists(self._record):  # resumed run: beat the earlier best
            with tf.io.gfile.GFile(self._record) as f:
                self.value = json.load(f)["value"]
        if jax.process_index() == 0:
            checkpointing.write_json(os.path.join(self.directory, "config.json"), config.to_dict())

    def update(self, step: int, state, results: dict) -> None:
        value = results[self.metric]
        if value <= self.value:
            return
        self.value = value
        self._ckpt.save(step, state, self._meta)
        self._ckpt.wait_until_finished()
        if jax.process_index() == 0:
            checkpointing.write_json(self._record, dict(step=step, metric=self.metric, value=value))
            logging.info(f"[best] step {step}: {self.metric} {value:.4f} -> {self.directory}")

    def close(self) -> None:
        self._ckpt.close()


class StopRequest:
    """Set by SIGTERM/SIGINT (preemption, Ctrl-C); the loop then saves and exits cleanly."""

    def __init__(self):
        self._event = threading.Event()

    def __call__(self, step: int) -> bool:
        return self._event.is_set()

    def set(self, *_):
        logging.warning("stop requested: saving a checkpoint and exiting")
        self._event.set()

    @contextlib.contextmanager
    def installed(self):
        """Handles SIGTERM/SIGINT while training; restores the previous handlers after."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.set) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _agree(flag: bool) -> bool:
    """All hosts must stop at the same step, so a stop on any host stops every host (one
    allgather: the loop asks only at log steps on multi-host runs)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.array(flag))))


def _clean_eval(ctx, params, batch_stats, fgsm_eps: float) -> dict:
    """The evaluation package's `clean` suite, under the names training logs."""
    result = clean_suite.run(
        ctx.with_variables(dict(params=params, batch_stats=batch_stats)), fgsm_eps=fgsm_eps
    )
    return dict(
        accuracy=result["top1"],
        loss=result["loss"],
        num_examples=result["num_examples"],
        **{k: result[k] for k in ("fgsm_accuracy",) if k in result},
    )


def initialize_from_checkpoint(config, state: train_step_lib.TrainState, mesh):
    """Replaces the classifier's initial params and BatchNorm statistics (and the EMA) by
    those of `config.init_from`; optimizer states start fresh."""
    current = dict(params=state.params, batch_stats=state.batch_stats)
    # Whole arrays on every host (FSDP shards too); the loaded ones go back into the state's
    # own layout.
    fresh = jax.device_get(jax.device_put(current, parallel.replicated(mesh)))
    variables = interop.load_checkpoint(
        config.init_from,
        fresh,
        ema=config.init_from_ema,
        reset_head=config.init_head == "reset",
        resize=config.init_resize,
    )
    variables = {
        k: jax.device_put(v, jax.tree.map(lambda x: x.sharding, current[k]))
        for k, v in variables.items()
    }
    params = variables["params"]
    logging.info(
        f"Initialised from {config.init_from}"
        f"{' (EMA weights)' if config.init_from_ema else ''}"
        f"{'; new head' if config.init_head == 'reset' else ''}"
    )
    return state.replace(
        params=params,
        batch_stats=variables.get("batch_stats", {}),
        ema_params=jax.tree.map(jnp.copy, params) if state.ema_params else {},
        ema_batch_stats=jax.tree.map(jnp.copy, variables.get("batch_stats", {}))
        if state.ema_batch_stats
        else {},
    )


@contextlib.contextmanager
def _workdir_locked(workdir: str, force: bool):
    """Holds `workdir`'s lock (workdir_lock) while the run writes into it; process 0 takes
    it, and every host stops when it cannot, before anything is written or compiled.
    Yields the lock on process 0, None on the others."""
    lock, refusal = None, None
    if jax.process_index() == 0:
        try:
            lock = workdir_lock.acquire(workdir, force=force)
        except workdir_lock.WorkdirLockedError as error:
            refusal = error
    if _agree(refusal is not None):
        raise refusal or workdir_lock.WorkdirLockedError(
            f"process 0 could not take the lock of the workdir {workdir}; its log says why."
        )
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()


def train_and_evaluate(
    config: ml_collections.ConfigDict,
    workdir: str,
    should_stop: Callable[[int], bool] | None = None,
    *,
    force_unlock: bool = False,
    accept_config_change: bool = False,
) -> dict:
    """Trains (or resumes) the run in `workdir`.

    Returns the final state, the step reached and the last evaluation ('eval', and
    'eval_ema' with EMA). `should_stop(step)` can end the run early, like SIGTERM; it is
    asked after each call of the step, i.e. after each of config.steps_per_call steps
    between log, eval and checkpoint steps. The run holds the workdir's lock throughout
    (workdir_lock: a second run on the same workdir is refused); `force_unlock` takes it
    from a run that still looks alive. A resume whose config changes what the saved run
    trains is refused before anything is written (interop.run_record), unless
    `accept_config_change`: then the change is recorded with its step.
    """
    setup.validate_config(config)
    workdir = resolve_workdir(workdir)  # its test file is gone again when it returns
    change = _config_change(config, workdir, accept_config_change)
    with _workdir_locked(workdir, force_unlock) as lock:
        checked = {}  # the step's footprint and memory limit, once it compiled
        try:
            return _train_and_evaluate(config, workdir, should_stop, lock, checked, change)
        except metrics_lib.NonFiniteLossError as error:  # raised after the save in flight
            raise _non_finite(config, workdir, error) from None
        except (tf.errors.DataLossError, tf.errors.NotFoundError) as error:
            if isinstance(error, tf.errors.NotFoundError) and not _record_file(error.message):
                raise
            raise _damaged_data(config, workdir, error) from None
        except jax.errors.JaxRuntimeError as error:  # raised after the save in flight is done
            if not memory_check.is_resource_exhausted(error):
                raise
            resume = _resume_point(os.path.join(workdir, "checkpoints"))
            found, limit = checked.get("footprint"), checked.get("limit")
            raise memory_check.ran_out(config, found, limit, error, resume) from error


def _config_change(config, workdir: str, accept: bool) -> dict:
    """{field: (saved, new)} of what `config` changes of what the run in `workdir` trains;
    {} for a new run (no checkpoint yet) or an unchanged one. A change stops here with
    run_record's paragraph unless `accept`: before anything is written or compiled."""
    step = checkpointing.latest_step(os.path.join(workdir, "checkpoints"))
    saved = run_record.read_json(os.path.join(workdir, run_record.CONFIG))
    if step is None or saved is None:
        return {}
    changed = run_record.math_changes(
        saved, run_record.as_saved(config), lambda: _has_batch_norm(config)
    )
    if changed and not accept:
        length_changed = any(key in changed for key in run_record.LENGTH)
        finished = length_changed and step >= _saved_total_steps(config, saved)
        raise run_record.refusal(workdir, changed, step, finished)
    return changed


def _has_batch_norm(config) -> bool:
    """Whether the model of `config` keeps BatchNorm statistics (from its shapes alone)."""
    model = setup.build_model(config, datasets.dataset_spec(config.dataset).num_classes)
    return bool(models.abstract_variables(model, config.image_size).get("batch_stats"))


def _saved_total_steps(config, saved: dict) -> int | float:
    """The length of the run whose config.json is `saved` (its data read where `config`
    reads it); infinite where it cannot be told (a config.json of an older version, its
    dataset no longer prepared here), so that the run does not count as finished."""
    saved = ml_collections.ConfigDict(saved)
    saved.data_dir = config.data_dir
    try:
        return _schedule(saved, datasets.dataset_spec(saved.dataset)).total_steps
    except (AttributeError, KeyError, ReportedError, tf.errors.OpError):
        return float("inf")


def _record_change(workdir: str, config, change: dict, step: int, logger) -> None:
    """An accepted change of the settings (`_config_change`) into the workdir's history,
    the log, metrics.jsonl and TensorBoard, as taking effect after `step`."""
    saved = run_record.read_json(os.path.join(workdir, run_record.CONFIG))
    path = run_record.record_change(workdir, saved, run_record.as_saved(config), change, step)
    logging.warning(
        f"Settings changed after step {step} ({run_record.ACCEPT_FLAG}): "
        f"{run_record.describe(change)}; recorded in {path}"
    )
    logger.write_config_change(step, change)


def _non_finite(config, workdir: str, error) -> metrics_lib.NonFiniteLossError:
    """The non-finite step's paragraph with what is true of the workdir (no checkpoint
    yet, or the last one) and, when the run's first step is the bad one, its initial weights."""
    checkpoints = os.path.join(workdir, "checkpoints")
    rerun = (
        "rerunning starts the run again from step 0"
        if checkpointing.latest_step(checkpoints) is None
        else "rerunning resumes from that checkpoint"
    )
    if error.step == 1:
        initial = (
            f"the weights of config.init_from={config.init_from}"
            if config.init_from
            else "the freshly initialised weights (the model's settings)"
        )
        advice = (
            f"The run's first step is the bad one, so suspect its initial weights, {initial}, "
            "as well as the learning rate (config.optimizer.lr) and the data"
        )
    else:
        advice = "Lower the learning rate (config.optimizer.lr), or check the data"
    return metrics_lib.NonFiniteLossError(
        f"{error} {_resume_point(checkpoints)}. {advice}; {rerun}.", step=error.step
    )


def _train_and_evaluate(config, workdir, should_stop, lock, checked: dict, change: dict) -> dict:
    """train_and_evaluate in a locked, existing `workdir`; `checked` receives the step's
    memory footprint and limit (`_compiled_ahead`); `change` is the accepted change of
    settings to record (`_config_change`)."""
    spec = datasets.dataset_spec(config.dataset)
    model = setup.build_model(config, spec.num_classes)
    setup.check_model_fits(config, model)
    schedule = _schedule(config, spec)
    mesh = parallel.create_mesh()
    parts = setup.build(config, model, spec, mesh, schedule.steps_per_epoch, schedule.total_steps)
    ckpt = checkpointing.Checkpointer(
        os.path.join(workdir, "checkpoints"), max_to_keep=config.keep_checkpoints
    )
    memory = None
    if (checkpointing.latest_step(ckpt.directory) or 0) < schedule.total_steps:
        # Before the state exists: a step that cannot fit stops before anything is allocated.
        memory = _compiled_ahead(config, parts, mesh, checked)
    state = parts.init(jax.random.PRNGKey(config.seed))
    meta = _checkpoint_meta(config)
    start_step, state = _restore_or_initialize(config, state, ckpt, meta, mesh, schedule)
    if start_step >= schedule.total_steps:
        ckpt.close()
        return _finished(workdir, state, start_step)
    if memory is None:  # the finished run's last checkpoint was unreadable and set aside
        memory = _compiled_ahead(config, parts, mesh, checked, state)
    memory.release()  # what compiling the state's initialiser left
    # Records of steps after the restored checkpoint (the killed run's) are dropped.
    logger = metrics_lib.MetricsLogger(workdir, schedule.total_steps, config.batch_size, start_step)
    if change and jax.process_index() == 0:
        _record_change(workdir, config, change, start_step, logger)
    if jax.process_index() == 0:
        checkpointing.write_json(os.path.join(workdir, run_record.CONFIG), config.to_dict())
    best = BestKeeper(workdir, config, meta) if config.keep_best else None
    _log_start(config, logger, state, schedule.total_steps)
    run = _Run(
        config=config,
        schedule=schedule,
        start_step=start_step,
        parts=parts,
        batches=_train_batches(config, schedule.train_split, start_step, mesh),
        evaluate=_evaluator(config, model, mesh, logger, best),
        ckpt=ckpt,
        meta=meta,
        logger=logger,
        lock=lock,
        memory=memory,
    )
    try:
        state, step, final = _train(run, state, should_stop)
    finally:
        ckpt.close()  # waits for the save in flight and raises if it failed
        if best is not None:
            best.close()
        logger.close()
    if step == schedule.total_steps and jax.process_index() == 0:
        _log_done(run, final, workdir)
    return dict(state=state, step=step, total_steps=schedule.total_steps, **final)


def _finished(workdir: str, state, step: int) -> dict:
    """A finished run, rerun: says so and writes nothing (no evaluation again, no records);
    returns what the run returned, its last evaluation read back from metrics.jsonl."""
    metrics = os.path.join(workdir, "metrics.jsonl")
    last = [r for r in metrics_lib.read_metrics(metrics) if r.get("step") == step]
    final = {}
    for kind in ("eval", "eval_ema"):
        values = {
            k.split("/", 1)[1]: v for r in last for k, v in r.items() if k.startswith(kind + "/")
        }
        if values:
            final[kind] = values
    report = os.path.join(workdir, "eval", "report.md")
    report = report if tf.io.gfile.exists(report) else metrics
    logging.info(
        f"This run is done: step {step} of {step}; its report is at {report}. Nothing was "
        "written; pass another --workdir to train a new run."
    )
    return dict(state=state, step=step, total_steps=step, **final)


def _checkpoint_meta(config) -> dict:
    """What a checkpoint records of the config (a resume checks that it matches)."""
    return dict(
        model_name=config.model_name,
        dataset=config.dataset,
        image_size=config.image_size,
        rspc_enabled=config.rspc.enabled,
    )


class _Schedule(NamedTuple):
    """How many steps the run takes and which of them evaluate."""

    train_split: str
    steps_per_epoch: int
    total_steps: int
    eval_every: int


def _schedule(config, spec) -> _Schedule:
    """The run's steps from the config and the size of the training split (which fails with
    preparation instructions if the dataset is missing)."""
    train_split = config.train_split or spec.train_split
    num_train = records.num_examples(
        dataset=config.dataset, data_dir=config.data_dir, split=train_split
    )
    steps_per_epoch = max(num_train // config.batch_size, 1)
    return _Schedule(
        train_split=train_split,
        steps_per_epoch=steps_per_epoch,
        total_steps=config.total_steps or int(config.num_epochs * steps_per_epoch),
        eval_every=config.eval_every_steps or steps_per_epoch,
    )


def _restore_or_initialize(config, state, ckpt, meta: dict, mesh, schedule: _Schedule):
    """(start step, state): the workdir's newest readable checkpoint (unreadable steps are
    skipped and moved aside), else `config.init_from`, else the fresh `state` at step 0."""
    restored = ckpt.restore_latest(state, meta)
    if restored is not None:
        start_step, state = restored
        logging.info(
            f"Resumed from {ckpt.directory}/{start_step} (step {start_step}/{schedule.total_steps})"
        )
        return start_step, state
    if config.init_from:
        state = initialize_from_checkpoint(config, state, mesh)
    return 0, state


def _log_start(config, logger, state, total_steps: int) -> None:
    """The config as hyperparameters of the run's records, and one line about the run."""
    logger.write_hparams(
        {
            k: v
            for k, v in run_record.flatten(config.to_dict()).items()
            if isinstance(v, (int, float, str, bool))
        }
    )
    num_params = int(parameter_overview.count_parameters(state.params))
    logging.info(
        f"Model {config.model_name}: {num_params:,} parameters; RSPC "
        f"{'on' if config.rspc.enabled else 'off'}; {jax.device_count()} devices "
        f"({jax.devices()[0].platform}), {jax.process_count()} hosts; {total_steps} steps "
        f"of {config.batch_size} images"
    )


def _train_batches(config, train_split: str, start_step: int, mesh):
    """This host's share of the training batches from `start_step` on, on the mesh."""
    return parallel.prefetch_to_mesh(
        train_data.train_iterator(
            dataset=config.dataset,
            data_dir=config.data_dir,
            split=train_split,
            image_size=config.image_size,
            local_batch_size=config.batch_size // jax.process_count(),
            seed=config.seed,
            start_step=start_step,
            **train_data.recipe_args(config),
        ),
        mesh,
    )


def _evaluator(config, model, mesh, logger, best) -> Callable:
    """`evaluate(step, state)`: the clean suite on every eval example once, in batches of
    config.eval_batch_size, for the classifier and its EMA; writes the records, offers the
    result to `best`, and returns {'eval': ..., 'eval_ema': ...}."""
    settings = ml_collections.ConfigDict(
        dict(config.evaluation.to_dict(), num_examples=0, batch_size=0)
    )
    ctx = run_suites.build_context(
        config, model, settings=settings, mesh=mesh, compute_dtype=setup.compute_dtype(config)
    )

    def evaluate(step: int, state) -> dict:
        results = {}
        for name, params, batch_stats in (
            ("eval", state.params, state.batch_stats),
            ("eval_ema", state.ema_params, state.ema_batch_stats or state.batch_stats),
        ):
            if params:
                # Whole parameters once per evaluation, not per batch (FSDP shards them).
                params = jax.device_put(params, parallel.replicated(mesh))
                results[name] = _clean_eval(ctx, params, batch_stats, config.eval_fgsm_eps)
                logger.write(step, results[name], name)
        if best is not None:
            best.update(step, state, results["eval"])
        return results

    return evaluate


def _blocks(config) -> bool:
    """Whether each step call blocks on its outputs: on CPU by default, where queued
    collectives deadlock on few cores."""
    choice = config.block_each_step
    return choice == "yes" or (choice == "auto" and jax.devices()[0].platform == "cpu")


@dataclasses.dataclass(frozen=True)
class _Run:
    """What stays the same through a run's steps."""

    config: ml_collections.ConfigDict
    schedule: _Schedule
    start_step: int  # the restored checkpoint's step, 0 for a new run
    parts: setup.Parts  # the compiled step (and several-step call) and the state's init
    batches: Iterator  # training batches from start_step on, on the mesh
    evaluate: Callable  # (step, state) -> eval results, see `_evaluator`
    ckpt: checkpointing.Checkpointer
    meta: dict  # what a checkpoint records of the config
    logger: metrics_lib.MetricsLogger
    lock: workdir_lock.WorkdirLock | None  # process 0's hold on the workdir
    memory: host_memory.StepMemory  # the loop's hook into host memory

    @property
    def blocks(self) -> bool:
        return _blocks(self.config)

    def is_steady(self, step: int) -> bool:
        return _is_steady(
            step,
            first=self.start_step + 1,
            last=self.schedule.total_steps,
            every=(
                self.config.log_every_steps,
                self.schedule.eval_every,
                self.config.checkpoint_every_steps,
            ),
        )


def _train(run: _Run, state, should_stop) -> tuple:
    """Steps from `run.start_step` to the end of the schedule or a stop request (SIGTERM,
    SIGINT, `should_stop`), with the records, evaluations and checkpoints of the steps
    where they fall. Returns (state, step reached, last evaluation)."""
    config, step, final, memory, batches = run.config, run.start_step, {}, run.memory, run.batches
    pending = _PendingMetrics(step)
    stop = StopRequest()
    with stop.installed():
        while step < run.schedule.total_steps:
            _check_saves(run, step)
            count = _steps_in_next_call(run, step)
            steady = run.is_steady(step + count)  # a call of several holds only steady steps
            step += count
            last = step == run.schedule.total_steps
            with jax.transfer_guard(config.transfer_guard if steady else "allow"):
                state, step_metrics = _call_step(run, state, count, batches, memory)
                requested = stop(step) or (should_stop is not None and should_stop(step))
                stopping = _stop_agreed(run, step, last, requested)
            pending.add(step_metrics)
            if step == run.start_step + 1:
                jax.block_until_ready(step_metrics)
                run.logger.start_timer(step)  # throughput without compilation
            evaluated = _records_and_saves(run, state, step, last, stopping, pending, memory)
            if evaluated is not None:
                final = evaluated
            if stopping and not last:
                _stop_saved(run, step)
                break
    return state, step, final


def _compiled_ahead(config, parts: setup.Parts, mesh, checked: dict, state=None):
    """The loop's host-memory hook (host_memory.StepMemory), after compiling the step programs
    for the state's and batch's shapes (the first call then finds them cached) and checking
    them against the memory they will have (`_check_memory`, which fills `checked`); `state`
    is the live state if there is one already."""
    abstract = parts.state_shapes
    batch = setup.abstract_batch(mesh, config.batch_size, config)
    lowered = [parts.train_step.lower(abstract, batch)]
    if parts.train_steps is not None:
        lowered.append(parts.train_steps.lower(abstract, (batch,) * config.steps_per_call))
    resident = sum(
        shard.data.nbytes for leaf in jax.tree.leaves(state) for shard in leaf.addressable_shards
    )
    return host_memory.StepMemory.compiled_ahead(
        lowered,
        calls_block=_blocks(config),
        check=lambda programs: _check_memory(config, programs, abstract, resident, checked),
    )


def _check_memory(config, programs: list, state, resident: int, checked: dict) -> None:
    """Refuses a step that does not fit the memory it will run in (memory_check), unless
    config.memory_check is off; keeps its footprint and limit in `checked`. `resident`:
    bytes of the step's arguments that this process holds already."""
    found = memory_check.footprint(config, programs, state)
    limit = memory_check.limit(resident)
    checked.update(footprint=found, limit=limit)
    memory_check.log_fit(found, limit)
    if config.memory_check and limit is not None and not memory_check.fits(found.estimate, limit):
        raise memory_check.refusal(config, found, limit)


def _check_saves(run: _Run, step: int) -> None:
    """A failed background save stops the run here, at once on one host; hosts agree at log
    steps (where they wait for the save) so that all stop together."""
    if jax.process_count() == 1 or step % run.config.log_every_steps == 0:
        run.ckpt.check(wait=jax.process_count() > 1)


def _steps_in_next_call(run: _Run, step: int) -> int:
    """Steady steps (see `_is_steady`) go config.steps_per_call to a call, others alone."""
    together = range(step + 1, step + run.config.steps_per_call + 1)
    several = run.parts.train_steps is not None and all(map(run.is_steady, together))
    return len(together) if several else 1


def _call_step(run: _Run, state, count: int, batches, memory) -> tuple:
    """One call of the compiled step for the next `count` batches: (state, metrics)."""
    with memory.step_call():
        if count > 1:
            state, step_metrics = run.parts.train_steps(
                state, tuple(next(batches) for _ in range(count))
            )
        else:
            state, step_metrics = run.parts.train_step(state, next(batches))
        if run.blocks:  # queued collectives deadlock on few-core CPUs
            jax.block_until_ready(step_metrics)
    return state, step_metrics


def _stop_agreed(run: _Run, step: int, last: bool, requested: bool) -> bool:
    """Whether every host stops after `step`: asked at once on one host, at log steps (and
    the last) across hosts."""
    log_step = step % run.config.log_every_steps == 0 or last
    return _agree(requested) if log_step or jax.process_count() == 1 else False


class _PendingMetrics:
    """The metrics of the steps since the last train record."""

    def __init__(self, step: int):
        self.metrics, self.start = [], step

    def add(self, step_metrics) -> None:
        self.metrics.append(step_metrics)

    def flush(self, step: int) -> dict:
        """Their mean (checking every step for non-finite numbers); starts over after `step`."""
        mean = metrics_lib.mean_and_check(self.metrics, self.start)
        self.metrics, self.start = [], step
        return mean


def _records_and_saves(run: _Run, state, step: int, last, stopping, pending, memory):
    """The train record, evaluation and checkpoint due after `step`; returns the evaluation's
    results if one ran."""
    config = run.config
    save = last or stopping or step % config.checkpoint_every_steps == 0
    evaluate = step % run.schedule.eval_every == 0 or last
    if step % config.log_every_steps == 0 or save or evaluate:
        # Checks every pending step for non-finite numbers before any save (or eval, which may
        # keep the best state).
        run.logger.write(step, pending.flush(step), "train")
        if run.lock is not None:
            run.lock.check()  # another run took the workdir over: stop before saving
    results = None
    if evaluate:
        results = run.evaluate(step, state)
        memory.release()  # the first evaluation compiles the eval steps
        run.logger.start_timer(step)
    if save:
        run.ckpt.save(step, state, run.meta)
        logging.info(f"Saving checkpoint {run.ckpt.directory}/{step}")
    return results


def _stop_saved(run: _Run, step: int) -> None:
    run.ckpt.wait_until_finished()
    logging.info(
        f"Stopped at step {step}: checkpoint saved in {run.ckpt.directory}; rerun the same "
        "command to resume."
    )


def _log_done(run: _Run, final: dict, workdir: str) -> None:
    acc = final.get("eval", {}).get("accuracy")
    logging.info(
        f"Done: {run.schedule.total_steps} steps; test accuracy {acc:.4f}. Metrics: "
        f"{run.logger.jsonl_path} and TensorBoard events in {workdir}; checkpoints: "
        f"{run.ckpt.directory}"
    )


def _is_steady(step: int, *, first: int, last: int, every: tuple[int, ...]) -> bool:
    """Whether `step` only dispatches: not the first or last step, nor a log, eval or
    checkpoint step, so no host<->device sync and no collective across hosts (a stop
    request is agreed at the next log step on multi-host runs)."""
    return step not in (first, last) and all(step % n for n in every)
