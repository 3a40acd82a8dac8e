"""What a workdir says about the settings its run trained with.

`config.json` holds the settings the run trains with now (evaluate and export build the
model from it). A resume compares the command's config with it (`math_changes`) and refuses
a change of what is trained (`ConfigChangeError`) unless the user accepts it; an accepted
change goes into `config_history.jsonl` beside config.json (`record_change`): its first line
holds the run's first settings at step 0, each further line a change with the step after
which it took effect and the settings from then on. A run whose settings never changed has
no history file. `changes_note` says, for evaluate, export and the study's reports, when the
settings of the weights they read changed on the way.
"""

import json
import os
import shlex

import tensorflow as tf

from rspc_jax import ConfigError
from rspc_jax.interop import checkpoints

CONFIG = "config.json"
HISTORY = "config_history.jsonl"
ACCEPT_FLAG = "--accept_config_change"

# The config fields (dotted keys; a key covers every field under it) whose value does not
# change what a run trains, so a resume may change them without a word: how often it logs,
# evaluates and saves, and what evaluation, analysis and the study read (the trained
# weights are the same); how the same step is executed (sharding, rematerialisation, blocks
# as a scan, steps per compiled call, blocking, the transfer guard, the memory check: the
# same update up to float rounding); where the prepared data lives; and the imported weights,
# which a resume ignores (it restores its own checkpoint). An allow-list on purpose: a field
# missing here, such as one added later, counts as a change of the math until it is listed.
SAME_MATH = (
    "analysis",
    "block_each_step",
    "checkpoint_every_steps",
    "data_dir",
    "distributed",
    "eval_batch_size",
    "eval_every_steps",
    "eval_fgsm_eps",
    "eval_preprocess",
    "eval_split",
    "evaluation",
    "init_from",
    "init_from_ema",
    "init_head",
    "init_resize",
    "keep_best",
    "keep_checkpoints",
    "log_every_steps",
    "memory_check",
    "remat",
    "scan_blocks",
    "sharding",
    "steps_per_call",
    "study",
    "transfer_guard",
)
# Micro-batches give the update of the whole batch, except that BatchNorm normalises each
# micro-batch (docs/speed.md): a change of this field changes the math only with BatchNorm.
ACCUMULATION = "grad_accum_steps"
# Fields that set the run's length: changing them recomputes the learning-rate schedule.
LENGTH = ("num_epochs", "total_steps")
ABSENT = "(not set)"


class ConfigChangeError(ConfigError):
    """A resume whose command changes what the saved run trains, without the flag that
    accepts the change."""


def flatten(tree: dict, prefix: str = "") -> dict:
    """{'a': {'b': 1}} -> {'a.b': 1}: a config's fields by dotted key."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def as_saved(config) -> dict:
    """`config` as config.json holds it (tuples as lists, other objects as strings), so
    that a value compares equal to its saved form."""
    return json.loads(json.dumps(config.to_dict(), default=str))


def _same_math(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in SAME_MATH)


def math_changes(saved: dict, new: dict, batch_norm) -> dict:
    """{dotted key: (saved value, new value)} of the fields whose change alters what is
    trained; `ABSENT` for a field one side lacks. `batch_norm()` says whether the model has
    BatchNorm (asked only when the accumulation changed)."""
    saved, new = flatten(saved), flatten(new)
    changed = {
        key: (saved.get(key, ABSENT), new.get(key, ABSENT))
        for key in sorted(saved.keys() | new.keys())
        if saved.get(key, ABSENT) != new.get(key, ABSENT) and not _same_math(key)
    }
    if ACCUMULATION in changed and not batch_norm():
        del changed[ACCUMULATION]
    return changed


def read_json(path: str) -> dict | None:
    """The JSON object in file `path`, None when there is none."""
    if not tf.io.gfile.exists(path):
        return None
    with tf.io.gfile.GFile(path) as f:
        return json.load(f)


def _flag_value(value) -> str:
    """A saved value as a --config.<field> flag takes it (lists were tuples)."""
    text = repr(tuple(value)) if isinstance(value, list) else str(value)
    return shlex.quote(text)


def describe(changed: dict) -> str:
    """'batch_size 64 → 32, optimizer.lr 0.0005 → 0.01'."""
    return ", ".join(f"{key} {old} → {new}" for key, (old, new) in changed.items())


def _length_sentence(changed: dict, step: int, finished: bool) -> str:
    """What a change of the run's length does, when one of `LENGTH` changed."""
    if not any(key in changed for key in LENGTH):
        return ""
    extends = f"The run ended at step {step}, so this extends it, and a" if finished else "A"
    return (
        f" {extends} new length recomputes the learning-rate schedule (warm-up, cosine, "
        f"cool-down) over the new number of steps: the steps after {step} follow another "
        "curve than the first ones did."
    )


def refusal(workdir: str, changed: dict, step: int, finished: bool) -> ConfigChangeError:
    """The paragraph of a resume that changes what is trained: each field saved → new,
    and the two ways on."""
    flags = " ".join(
        f"--config.{key}={_flag_value(old)}" for key, (old, _) in changed.items() if old != ABSENT
    )
    state = f"finished at step {step}" if finished else f"trained to step {step}"
    return ConfigChangeError(
        f"--workdir {workdir} holds a run {state} whose settings differ from this command's "
        f"in what is trained: {describe(changed)} (saved in {os.path.join(workdir, CONFIG)} → "
        f"this command). Going on with them would train the steps after {step} otherwise "
        "than the first ones while the record named one set of settings for all, so nothing "
        f"was run or written.{_length_sentence(changed, step, finished)} To keep the run as "
        f"it was, rerun with the saved values: {flags or '(the saved config)'}. To go on with "
        f"the change deliberately, rerun with {ACCEPT_FLAG}: the change is recorded as taking "
        f"effect after step {step} in {os.path.join(workdir, HISTORY)}, metrics.jsonl and "
        "TensorBoard, and evaluate, export and the study's reports mention it. Or pass another "
        "--workdir to train a new run."
    )


def record_change(workdir: str, saved: dict, new: dict, changed: dict, step: int) -> str:
    """Appends the accepted change `changed` (the settings `new` after `step`) to the
    workdir's history, which starts with the `saved` settings at step 0 when it is new;
    written whole through a temporary file. Returns the history's path."""
    path = os.path.join(workdir, HISTORY)
    entries = read_history(workdir) or [dict(step=0, config=saved)]
    entries.append(dict(step=step, changed={k: list(v) for k, v in changed.items()}, config=new))
    partial = f"{path}.tmp"
    with tf.io.gfile.GFile(partial, "w") as f:
        f.write("".join(json.dumps(e, sort_keys=True) + "\n" for e in entries))
    tf.io.gfile.rename(partial, path, overwrite=True)
    return path


def read_history(workdir: str) -> list[dict]:
    """The entries of the workdir's config_history.jsonl; [] when its settings never changed."""
    path = os.path.join(workdir, HISTORY)
    if not tf.io.gfile.exists(path):
        return []
    with tf.io.gfile.GFile(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def changes_note(workdir: str, step: int | None = None) -> str | None:
    """One sentence naming each accepted change of the run in `workdir` that the weights of
    checkpoint `step` (default: the latest) were trained through, None when there is none."""
    if step is None:
        step = checkpoints.latest_step(os.path.join(workdir, "checkpoints"))
    changes = [e for e in read_history(workdir)[1:] if step is not None and e["step"] < step]
    if not changes:
        return None
    each = "; ".join(
        f"after step {e['step']}: {describe({k: tuple(v) for k, v in e['changed'].items()})}"
        for e in changes
    )
    return (
        f"the settings of the run in {workdir} changed on the way ({each}); "
        f"{os.path.join(workdir, HISTORY)} holds each set with its steps."
    )
