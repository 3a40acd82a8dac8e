"""The training loop: config -> state -> steps, evaluation, metrics, checkpoints, resume."""

import contextlib
import json
import os
import signal
import threading
import time
from typing import Callable, NamedTuple, Optional

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tensorflow as tf

from rspc_jax import adversarial_training
from rspc_jax import checkpointing
from rspc_jax import input_pipeline
from rspc_jax import interop
from rspc_jax import metrics as metrics_lib
from rspc_jax import models
from rspc_jax import optim
from rspc_jax import parallel
from rspc_jax import rspc
from rspc_jax import train_step as train_step_lib

_CHOICES = {
    "rspc.ste": ("clip", "identity"),
    "rspc.noise_space": ("normalized", "pixel"),
    "rspc.clamp": ("imagenet", "dataset", "none"),
    "rspc.selection": ("learned", "random"),
    "rspc.objective": ("align", "ce"),
    "rspc.fill": ("noise", "zero", "drop"),
    "adversarial.method": adversarial_training.METHODS,
    "adversarial.attack_bn": ("train", "eval"),
    "block_each_step": ("auto", "yes", "no"),
    "compute_dtype": ("float32", "bfloat16"),
    "patch_aug": ("off", "official", "intended"),
    "init_head": ("load", "reset"),
}


def _get(config, dotted: str):
    for part in dotted.split("."):
        config = config[part]
    return config


def validate_config(config: ml_collections.ConfigDict) -> None:
    """Fails on bad settings before anything is built or compiled."""
    for key, choices in _CHOICES.items():
        if _get(config, key) not in choices:
            raise ValueError(f"config.{key}={_get(config, key)!r} is not one of {choices}")
    if config.rspc.enabled:
        rspc.check_ratio(config.rspc.rho)
    if config.rspc.enabled and config.adversarial.method != "none":
        raise ValueError(f"config.adversarial.method={config.adversarial.method!r} is a baseline "
                         "that replaces RSPC; set config.rspc.enabled=False")
    if config.adversarial.method != "none" and not 0 < config.adversarial.eps <= 1:
        raise ValueError(f"config.adversarial.eps={config.adversarial.eps} must be in (0, 1] "
                         "(pixels in [0, 1]; e.g. 4/255)")
    if config.batch_size <= 0 or config.eval_batch_size <= 0:
        raise ValueError("batch_size and eval_batch_size must be positive")
    parallel.check_batch_size(config.batch_size)
    parallel.check_batch_size(config.eval_batch_size, "eval_batch_size")
    try:
        input_pipeline.check_augmentation(
            rand_augment=config.rand_augment, random_erase_prob=config.random_erase_prob,
            repeated_augment=config.repeated_augment, eval_preprocess=config.eval_preprocess)
    except ValueError as error:
        raise ValueError(f"bad augmentation setting in the config: {error}") from None
    if config.keep_best not in ("", "accuracy", "fgsm_accuracy"):
        raise ValueError(f"config.keep_best={config.keep_best!r} is not one of "
                         "('', 'accuracy', 'fgsm_accuracy')")
    if config.keep_best == "fgsm_accuracy" and config.eval_fgsm_eps <= 0:
        raise ValueError("config.keep_best='fgsm_accuracy' needs config.eval_fgsm_eps > 0")
    if config.init_from and not tf.io.gfile.exists(config.init_from):
        raise FileNotFoundError(f"config.init_from: checkpoint {config.init_from} does not exist")


def build_model(config, num_classes: int):
    overrides = dict(config.model)
    model = models.create(config.model_name, num_classes=num_classes, **overrides)
    for option in ("remat", "scan_blocks"):
        if config.get(option):
            if not models.has_field(model, option):
                raise ValueError(f"config.{option}=True: {config.model_name} has no {option} "
                                 "option (scan_blocks: ViT/DeiT models only); set it to False")
            model = model.clone(**{option: True})
    if config.bn_cross_device and models.has_field(model, "bn_axis_name"):
        model = model.clone(bn_axis_name=parallel.DATA_AXIS)
    return model


def rspc_patch_size(config, model) -> int:
    return config.rspc.patch_size or model.patch_size


def check_model_fits(config, model) -> None:
    """The image size divides into the model's and RSPC's patches; token dropping has a
    model that supports it, with one RSPC patch per token."""
    if config.rspc.enabled and config.rspc.fill == "drop":
        if not getattr(model, "supports_token_dropping", False):
            raise ValueError(
                f"config.rspc.fill='drop' removes tokens from the sequence, which {config.model_name} "
                "cannot do (RVT, FAN and XCiT mix tokens with convolutions on the token grid); "
                "use a ViT/DeiT model or fill='noise'/'zero'")
        if rspc_patch_size(config, model) != model.patch_size:
            raise ValueError(f"config.rspc.fill='drop' needs rspc.patch_size equal to the model's "
                             f"token size {model.patch_size}; leave rspc.patch_size at 0")
    sizes = {"model patch_size": model.patch_size}
    if config.rspc.enabled:
        sizes["rspc.patch_size"] = rspc_patch_size(config, model)
    for what, patch in sizes.items():
        if config.image_size % patch:
            raise ValueError(
                f"image_size {config.image_size} is not divisible by the {what} {patch}; "
                f"use an image size that is a multiple of {patch}")


def step_settings(config, spec: input_pipeline.DatasetSpec,
                  steps_per_epoch: int = 1) -> train_step_lib.StepSettings:
    """Resolves the RSPC (or adversarial-training) switches into the static numbers the
    step needs; `steps_per_epoch` times the eps warm-up."""
    r = config.rspc
    if r.noise_space == "pixel":
        noise_mean, noise_std = tuple(spec.mean), tuple(spec.std)
    else:
        noise_mean, noise_std = (0.0,), (1.0,)
    lower = upper = None
    if r.clamp != "none":
        mean, std = ((rspc.IMAGENET_MEAN, rspc.IMAGENET_STD) if r.clamp == "imagenet"
                     else (spec.mean, spec.std))
        lower, upper = (tuple(float(v) for v in np.asarray(a))
                        for a in rspc.normalized_limits(mean, std))
    mix = config.mixup
    mixup = None
    if mix.mixup_alpha > 0 or mix.cutmix_alpha > 0:
        mixup = dict(mixup_alpha=mix.mixup_alpha, cutmix_alpha=mix.cutmix_alpha,
                     switch_prob=mix.switch_prob, prob=mix.prob)
    return train_step_lib.StepSettings(
        num_classes=spec.num_classes, rspc_enabled=r.enabled, rho=r.rho, lam=r.lam,
        ste_clip=1.0 if r.ste == "clip" else None, occ_grad_scale=r.occ_grad_scale,
        noise_mean=noise_mean, noise_std=noise_std, clamp_lower=lower, clamp_upper=upper,
        random_selection=r.selection == "random",
        align_blocks=tuple(r.align_blocks) or None, label_smoothing=config.label_smoothing,
        mixup=mixup, ema_decay=config.ema_decay, occ_lr=r.optimizer.lr,
        compute_dtype=compute_dtype(config), patch_aug=config.patch_aug,
        rspc_objective=r.objective, fill=r.fill,
        adversarial=adversarial_training.resolve(config, steps_per_epoch),
        pixel_mean=tuple(spec.mean), pixel_std=tuple(spec.std))


def compute_dtype(config):
    """None for float32 (no casts), else the jnp dtype of the forward pass."""
    return None if config.compute_dtype == "float32" else jnp.dtype(config.compute_dtype)


def resolve_workdir(workdir: str) -> str:
    """Creates `workdir`; local paths become absolute (orbax needs that), gs:// stays."""
    if "://" not in workdir:
        workdir = os.path.abspath(workdir)
    tf.io.gfile.makedirs(workdir)
    return workdir


class BestKeeper:
    """Early stopping as the thesis does it: the state of the best eval by
    `config.keep_best` goes to <workdir>/best, itself a workdir (config.json +
    checkpoints/<step>) that evaluate and export read with --workdir=<workdir>/best."""

    def __init__(self, workdir: str, config, meta: dict):
        self.directory = os.path.join(workdir, "best")
        self.metric = config.keep_best
        self._meta = meta
        self._ckpt = checkpointing.Checkpointer(os.path.join(self.directory, "checkpoints"),
                                                max_to_keep=1)
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
            print(f"[best] step {step}: {self.metric} {value:.4f} -> {self.directory}", flush=True)

    def close(self) -> None:
        self._ckpt.wait_until_finished()
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
    """All hosts must stop at the same step, so a stop on any host stops every host."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils
    return bool(np.any(multihost_utils.process_allgather(np.array(flag))))


def evaluate(eval_step, params, batch_stats, eval_batches, num_batches, mesh) -> dict:
    totals = None
    start = time.time()
    for i, batch in enumerate(parallel.prefetch_to_mesh(iter(eval_batches), mesh)):
        sums = eval_step(params, batch_stats, batch)
        totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
        if num_batches > 20 and (i + 1) % max(num_batches // 10, 1) == 0 and jax.process_index() == 0:
            print(f"[eval] batch {i + 1}/{num_batches} ({time.time() - start:.0f}s)", flush=True)
    totals = jax.device_get(totals)
    count = float(totals["count"])
    result = dict(accuracy=float(totals["correct"]) / count, loss=float(totals["ce"]) / count,
                  num_examples=count)
    if "fgsm_correct" in totals:
        result["fgsm_accuracy"] = float(totals["fgsm_correct"]) / count
    return result


class Parts(NamedTuple):
    init: Callable          # rng -> replicated TrainState
    train_step: Callable    # (state, global batch) -> (state, metrics)
    eval_step: Callable     # (params, batch_stats, global batch) -> masked sums


def build(config, model, spec, mesh, steps_per_epoch: int, total_steps: int) -> Parts:
    """Optimizers, state initialiser and the jitted sharded steps for `mesh`."""
    image_shape = (config.image_size, config.image_size, 3)
    occ_model = (rspc.PatchCorruptionModel(rspc_patch_size(config, model))
                 if config.rspc.enabled else None)
    opt = config.optimizer
    schedule = optim.learning_rate(
        opt, batch_size=config.batch_size, total_steps=total_steps,
        warmup_steps=int(opt.warmup_epochs * steps_per_epoch),
        cooldown_steps=int(opt.cooldown_epochs * steps_per_epoch))
    abstract_params = jax.eval_shape(lambda: model.init(
        jax.random.PRNGKey(0), jnp.zeros((1,) + image_shape), train=False))["params"]
    tx = optim.classifier_optimizer(opt, schedule, abstract_params, model.no_weight_decay_names)
    occ_tx = optim.corruption_optimizer(config.rspc.optimizer)
    init = jax.jit(lambda rng: train_step_lib.create_train_state(
        rng, model, occ_model, image_shape, tx, occ_tx, ema=config.ema_decay > 0),
        out_shardings=parallel.replicated(mesh))
    train_step = train_step_lib.make_train_step(
        mesh, model=model, occ_model=occ_model, tx=tx, occ_tx=occ_tx, schedule=schedule,
        settings=step_settings(config, spec, steps_per_epoch))
    return Parts(init, train_step,
                 train_step_lib.make_eval_step(
                     mesh, model, compute_dtype(config),
                     fgsm=((config.eval_fgsm_eps, tuple(spec.mean), tuple(spec.std))
                           if config.eval_fgsm_eps > 0 else None)))


def initialize_from_checkpoint(config, state: train_step_lib.TrainState, mesh):
    """Replaces the classifier's initial params and BatchNorm statistics (and the EMA) by
    those of `config.init_from`; optimizer states start fresh."""
    fresh = jax.device_get(dict(params=state.params, batch_stats=state.batch_stats))
    variables = interop.load_checkpoint(
        config.init_from, fresh, ema=config.init_from_ema,
        reset_head=config.init_head == "reset", resize=config.init_resize)
    variables = jax.device_put(variables, parallel.replicated(mesh))
    params = variables["params"]
    print(f"Initialised from {config.init_from}"
          f"{' (EMA weights)' if config.init_from_ema else ''}"
          f"{'; new head' if config.init_head == 'reset' else ''}", flush=True)
    return state.replace(params=params, batch_stats=variables.get("batch_stats", {}),
                         ema_params=jax.tree.map(jnp.copy, params) if state.ema_params else {})


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       should_stop: Optional[Callable[[int], bool]] = None) -> dict:
    """Trains (or resumes) the run in `workdir`.

    Returns the final state, the step reached and the last evaluation ('eval', and
    'eval_ema' with EMA). `should_stop(step)` can end the run early, like SIGTERM.
    """
    validate_config(config)
    spec = input_pipeline.dataset_spec(config.dataset)
    model = build_model(config, spec.num_classes)
    check_model_fits(config, model)
    train_split = config.train_split or spec.train_split
    eval_split = config.eval_split or spec.eval_split
    # Fails with preparation instructions if the dataset is missing.
    num_train = input_pipeline.num_examples(dataset=config.dataset, data_dir=config.data_dir,
                                            split=train_split)
    steps_per_epoch = max(num_train // config.batch_size, 1)
    total_steps = config.total_steps or int(config.num_epochs * steps_per_epoch)
    eval_every = config.eval_every_steps or steps_per_epoch

    mesh = parallel.create_mesh()
    parts = build(config, model, spec, mesh, steps_per_epoch, total_steps)
    state = parts.init(jax.random.PRNGKey(config.seed))

    workdir = resolve_workdir(workdir)
    ckpt = checkpointing.Checkpointer(os.path.join(workdir, "checkpoints"),
                                      max_to_keep=config.keep_checkpoints)
    meta = dict(model_name=config.model_name, dataset=config.dataset,
                image_size=config.image_size, rspc_enabled=config.rspc.enabled)
    start_step = 0
    if ckpt.latest_step() is not None:
        state = ckpt.restore(ckpt.latest_step(), state, meta)
        start_step = int(jax.device_get(state.step))
        print(f"Resumed from {ckpt.directory}/{start_step} (step {start_step}/{total_steps})", flush=True)
    elif config.init_from:
        state = initialize_from_checkpoint(config, state, mesh)
    if jax.process_index() == 0:
        checkpointing.write_json(os.path.join(workdir, "config.json"), config.to_dict())
    best = BestKeeper(workdir, config, meta) if config.keep_best else None

    logger = metrics_lib.MetricsLogger(workdir, total_steps, config.batch_size)
    logger.write_hparams({k: v for k, v in _flat(config.to_dict()).items()
                          if isinstance(v, (int, float, str, bool))})
    num_params = sum(x.size for x in jax.tree.leaves(state.params))
    print(f"Model {config.model_name}: {num_params:,} parameters; RSPC "
          f"{'on' if config.rspc.enabled else 'off'}; {jax.device_count()} devices "
          f"({jax.devices()[0].platform}), {jax.process_count()} hosts; {total_steps} steps "
          f"of {config.batch_size} images", flush=True)

    train_step, eval_step = parts.train_step, parts.eval_step
    local_batch = config.batch_size // jax.process_count()
    train_batches = parallel.prefetch_to_mesh(input_pipeline.train_iterator(
        dataset=config.dataset, data_dir=config.data_dir, split=train_split,
        image_size=config.image_size, local_batch_size=local_batch, seed=config.seed,
        start_step=start_step, augment=config.augment, shuffle_buffer=config.shuffle_buffer,
        rand_augment=config.rand_augment, random_erase_prob=config.random_erase_prob,
        repeated_augment=config.repeated_augment, color_jitter=config.color_jitter,
        crop_area=tuple(config.crop_area) or None, crop_aspect=tuple(config.crop_aspect) or None),
        mesh)
    eval_batches, num_eval_batches = input_pipeline.eval_iterator(
        dataset=config.dataset, data_dir=config.data_dir, split=eval_split,
        image_size=config.image_size, local_batch_size=config.eval_batch_size // jax.process_count(),
        eval_preprocess=config.eval_preprocess)

    def run_eval(step):
        results = {}
        for name, params in (("eval", state.params), ("eval_ema", state.ema_params)):
            if params:
                results[name] = evaluate(eval_step, params, state.batch_stats, eval_batches,
                                         num_eval_batches, mesh)
                logger.write(step, results[name], name)
        if best is not None:
            best.update(step, state, results["eval"])
        return results

    block = config.block_each_step == "yes" or (
        config.block_each_step == "auto" and jax.devices()[0].platform == "cpu")
    stop = StopRequest()
    pending, pending_start = [], start_step
    step = start_step
    final = run_eval(step) if step >= total_steps else {}
    try:
        with stop.installed():
            while step < total_steps:
                state, step_metrics = train_step(state, next(train_batches))
                step += 1
                pending.append(step_metrics)
                if block:  # queued collectives deadlock on few-core CPUs
                    jax.block_until_ready(step_metrics)
                stopping = _agree(stop(step) or (should_stop is not None and should_stop(step)))
                last = step == total_steps
                save = last or stopping or step % config.checkpoint_every_steps == 0
                if step == start_step + 1:
                    jax.block_until_ready(step_metrics)
                    logger.start_timer(step)  # throughput without compilation
                if step % config.log_every_steps == 0 or save:
                    # Also checks every pending step for a non-finite loss before any save.
                    logger.write(step, metrics_lib.mean_and_check(pending, pending_start), "train")
                    pending, pending_start = [], step
                if step % eval_every == 0 or last:
                    final = run_eval(step)
                    logger.start_timer(step)
                if save:
                    ckpt.save(step, state, meta)
                    print(f"Saving checkpoint {ckpt.directory}/{step}", flush=True)
                if stopping and not last:
                    ckpt.wait_until_finished()
                    print(f"Stopped at step {step}: checkpoint saved in {ckpt.directory}; rerun the "
                          "same command to resume.", flush=True)
                    break
    finally:
        ckpt.wait_until_finished()
        ckpt.close()
        if best is not None:
            best.close()
        logger.close()
    if step == total_steps and jax.process_index() == 0:
        acc = final.get("eval", {}).get("accuracy")
        print(f"Done: {total_steps} steps; test accuracy {acc:.4f}. Metrics: "
              f"{logger.jsonl_path} and TensorBoard events in {workdir}; checkpoints: "
              f"{ckpt.directory}", flush=True)
    return dict(state=state, step=step, total_steps=total_steps, **final)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
