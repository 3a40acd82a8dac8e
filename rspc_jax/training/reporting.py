"""Metric output: clu writers (TensorBoard events + log), a JSON-lines file, a console line.

Only process 0 writes. Per-step metrics stay on device until a log step, then are
fetched together: no host sync per step, and every step is checked for a non-finite loss.
"""

import json
import math
import os
import time

from absl import logging
from clu import metric_writers
import jax
import numpy as np
import tensorflow as tf

from rspc_jax import ReportedError
from rspc_jax.interop import run_record


class NonFiniteLossError(ReportedError, FloatingPointError):
    """A step produced a non-finite loss, gradient or parameter; nothing of it was saved.
    `step` is the bad step's number (the training loop adds what is true of the workdir)."""

    def __init__(self, message: str, *, step: int):
        super().__init__(message)
        self.step = step


def mean_and_check(step_metrics: list[dict], first_step: int) -> dict:
    """Averages the metrics of the steps after `first_step` (one dict per call, stacked for a
    call of several steps); raises on the first step whose loss, gradients or updated
    parameters were not finite (flagged by the train step)."""
    fetched = [one for metrics in jax.device_get(step_metrics) for one in _each_step(metrics)]
    for offset, metrics in enumerate(fetched):
        loss = float(metrics["loss"])
        if metrics.get("nonfinite", 0.0) or not math.isfinite(loss):
            step = first_step + offset + 1
            raise NonFiniteLossError(
                f"step {step} was not finite (loss {loss:.4g}, gradient norm "
                f"{float(metrics['grad_norm']):.4g}); training stopped before saving anything "
                f"of step {step} or later.",
                step=step,
            )
    means = {k: np.mean([m[k] for m in fetched], axis=0) for k in fetched[0] if k != "nonfinite"}
    return {k: float(v) if v.ndim == 0 else v.tolist() for k, v in means.items()}


def _each_step(metrics: dict) -> list[dict]:
    """The metrics of each step of one call: a call of several steps stacks them."""
    if np.ndim(metrics["loss"]) == 0:
        return [metrics]
    return [{k: v[i] for k, v in metrics.items()} for i in range(len(metrics["loss"]))]


class MetricsWriteError(ReportedError, OSError):
    """metrics.jsonl or the TensorBoard events could not be written."""


_LEADING = ("loss", "ce", "align", "occluded_ce", "accuracy", "train_accuracy")


def _display_rank(key: str) -> int:
    """Losses and accuracies first on the console; the rest keep their order."""
    name = key.split("/", 1)[1]
    return _LEADING.index(name) if name in _LEADING else len(_LEADING)


def _format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def read_metrics(path: str) -> list[dict]:
    """The records of a `metrics.jsonl`, skipping a line cut short (a kill or a full disk
    while it was written)."""
    if not tf.io.gfile.exists(path):
        return []
    records = []
    with tf.io.gfile.GFile(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def truncate_metrics(path: str, last_step: int) -> None:
    """Keeps the records up to `last_step` (the step a run resumes from), so that the steps a
    killed run logged after its last checkpoint are not logged twice; written atomically."""
    if not tf.io.gfile.exists(path):
        return
    kept = [r for r in read_metrics(path) if r.get("step", 0) <= last_step]
    partial = f"{path}.tmp"
    with tf.io.gfile.GFile(partial, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in kept))
    tf.io.gfile.rename(partial, path, overwrite=True)


class MetricsLogger:
    """Writes scalars to TensorBoard, `metrics.jsonl` and stdout (process 0 only); a run that
    resumes from `start_step` first drops the records of later steps."""

    def __init__(self, workdir: str, total_steps: int, images_per_step: int, start_step: int = 0):
        self.enabled = jax.process_index() == 0
        self.total_steps = total_steps
        self.images_per_step = images_per_step
        self.jsonl_path = os.path.join(workdir, "metrics.jsonl")
        if self.enabled:
            truncate_metrics(self.jsonl_path, start_step)
        self._writer = metric_writers.create_default_writer(
            workdir, just_logging=not self.enabled, asynchronous=True
        )
        self._last_time: float | None = None
        self._last_step: int | None = None

    def _throughput(self, step: int) -> dict:
        now = time.time()
        out = {}
        if self._last_time is not None and step > self._last_step:
            steps_per_sec = (step - self._last_step) / (now - self._last_time)
            out = dict(
                steps_per_sec=steps_per_sec,
                images_per_sec=steps_per_sec * self.images_per_step,
                eta_sec=(self.total_steps - step) / steps_per_sec,
            )
        self._last_time, self._last_step = now, step
        return out

    def start_timer(self, step: int) -> None:
        """Times throughput from here (after compilation / evaluation pauses)."""
        self._last_time, self._last_step = time.time(), step

    def write(self, step: int, metrics: dict, prefix: str) -> None:
        """Scalars go everywhere; vectors (e.g. C's per-position selection frequency) only to
        metrics.jsonl, as lists."""
        metrics = {f"{prefix}/{k}": v for k, v in metrics.items()}
        if prefix == "train":
            metrics.update({f"train/{k}": v for k, v in self._throughput(step).items()})
        scalars = {k: v for k, v in metrics.items() if not isinstance(v, list)}
        if not self.enabled:
            return
        try:
            self._writer.write_scalars(step, scalars)
            with tf.io.gfile.GFile(self.jsonl_path, "a") as f:  # local or gs://
                f.write(json.dumps({"step": step, **metrics}) + "\n")
        except (OSError, tf.errors.OpError) as error:
            raise MetricsWriteError(
                f"cannot write the metrics of step {step} to {self.jsonl_path} ({error}); "
                "free disk space or fix permissions and rerun the same command to resume from "
                "the last checkpoint."
            ) from error
        logging.info(self._console_line(step, scalars, prefix))

    def _console_line(self, step: int, scalars: dict, prefix: str) -> str:
        pct = 100.0 * step / max(self.total_steps, 1)
        parts = [f"[{prefix}] step {step}/{self.total_steps} ({pct:.0f}%)"]
        for key, value in sorted(scalars.items(), key=lambda kv: _display_rank(kv[0])):
            name = key.split("/", 1)[1]
            if name == "eta_sec":
                parts.append(f"ETA {_format_duration(value)}")
            elif name in ("steps_per_sec", "images_per_sec"):
                parts.append(f"{name.replace('_per_sec', '/s')} {value:.1f}")
            else:
                parts.append(f"{name} {value:.4g}")
        return " | ".join(parts)

    def write_config_change(self, step: int, changed: dict) -> None:
        """An accepted change of the run's settings ({field: (old, new)}) as a row of
        metrics.jsonl ('config_change') and a text summary in TensorBoard."""
        if not self.enabled:
            return
        self._writer.write_texts(step, {"config_change": run_record.describe(changed)})
        row = {"step": step, "config_change": {k: list(v) for k, v in changed.items()}}
        with tf.io.gfile.GFile(self.jsonl_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def write_hparams(self, hparams: dict) -> None:
        if self.enabled:
            self._writer.write_hparams(hparams)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()
