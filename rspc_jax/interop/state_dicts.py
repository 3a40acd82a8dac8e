"""PyTorch checkpoints of registered models: read, write, and load into flax variables.

Files: `.safetensors` and `.npz` need no torch; anything else (`.pth`, `.pth.tar`, `.pt`,
`.bin`) is read and written with `torch.load` / `torch.save`. Containers the official code
writes or reads are unwrapped: timm's `CheckpointSaver` dict (`state_dict`,
`state_dict_ema`), DeiT/RVT's (`model`, `model_ema`), or a bare state dict, with DDP's
`module.` prefix stripped. Key names and layouts are `torch_layout`'s job; this module only
moves state dicts between files and models, so that every conversion has one place.
"""

import functools
import io
import os
import pickle
import re
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import tensorflow as tf

from rspc_jax import ReportedError, models
from rspc_jax.interop import layout as torch_layout

TORCH_HINT = "pip install -r requirements-torch.txt"
# Every registered classifier names its final Dense `head` (timm, RVT, FAN, XCiT).
HEAD = "head"
# Parameters tied to the token grid, which `resize` interpolates: RVT*'s PAAS masks
# (heads, N, N) and ViT/DeiT position embeddings (1, prefix + N, D).
GRID_PARAMETERS = ("att_mask", "pos_embed")
_ENTRIES = {False: ("state_dict", "model"), True: ("state_dict_ema", "model_ema")}


class TorchMissingError(ReportedError, ImportError):
    """A .pth/.pt file to read or write, and no PyTorch installed (the message says how)."""


def _import_torch(path: str):
    try:
        import torch
    except ImportError:
        raise TorchMissingError(
            f"{path} is a PyTorch file, which needs PyTorch: {TORCH_HINT} "
            "(or use .safetensors, which needs no torch)"
        ) from None
    return torch


def require_torch(path: str) -> None:
    """Fails now, with the fix, where writing `path` later would need PyTorch and it is missing."""
    _import_torch(path)


class CheckpointFileError(ReportedError, ValueError):
    """A weights file that cannot be read: incomplete, in another format than its suffix
    says, or holding Python objects that the safe loader refuses."""


def _refused_by_safe_loader(error: Exception) -> bool:
    """Whether `torch.load(weights_only=True)` refused the file's content: a pickle that
    holds Python objects other than tensors and containers (torch names the first one)."""
    return isinstance(error, pickle.UnpicklingError) and "Weights only load failed" in str(error)


def _not_weights_only(path: str, error: Exception) -> CheckpointFileError:
    """The paragraph of a .pth that the safe loader refuses, with how to convert it."""
    found = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
    what = f" (the first is {found.group(1)})" if found else ""
    return CheckpointFileError(
        f"checkpoint {path} holds Python objects that are not tensors{what}. Loading such a "
        "pickle can run code from it, so it is read only with PyTorch's safe loader "
        "(torch.load with weights_only=True), which refuses it. If you trust the file, "
        "convert it once in PyTorch: checkpoint = torch.load(PATH, weights_only=False), then "
        "torch.save(checkpoint['model'] (or whichever entry holds the state dict), "
        "'weights.pth'), or save that state dict with safetensors.torch.save_file as "
        ".safetensors, and pass the converted file."
    )


def _read_file(path: str) -> Any:
    if not tf.io.gfile.exists(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        with tf.io.gfile.GFile(path, "rb") as f:
            if path.endswith(".safetensors"):
                from safetensors import numpy as safetensors_numpy

                return safetensors_numpy.load(f.read())
            if path.endswith(".npz"):
                with np.load(f) as archive:
                    return dict(archive)
            # torch reads seekable files only; a GCS GFile is read into memory first.
            return _import_torch(path).load(
                io.BytesIO(f.read()), map_location="cpu", weights_only=True
            )
    except ImportError:
        raise
    except Exception as e:  # each reader has its own exception types for a bad file
        if _refused_by_safe_loader(e):
            raise _not_weights_only(path, e) from e
        raise CheckpointFileError(
            f"could not read checkpoint {path} ({type(e).__name__}: {e}); "
            "is the file complete and in the format its suffix says?"
        ) from e


def _is_tensor(value) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")


def _to_numpy(value) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    value = value.detach().cpu()
    if value.dtype.is_floating_point and value.element_size() < 4:
        value = value.float()  # numpy has no bfloat16; half precision is widened likewise
    return value.numpy()


def unwrap(
    checkpoint: Any, *, ema: bool = False, source: str = "checkpoint"
) -> dict[str, np.ndarray]:
    """The (EMA) state dict inside `checkpoint`, as numpy arrays without `module.` prefixes."""
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{source} holds a {type(checkpoint).__name__}, not a state dict")
    if checkpoint and all(_is_tensor(v) for v in checkpoint.values()):
        if ema:
            raise ValueError(
                f"{source} is a bare state dict with one set of weights; it has no "
                f"EMA entry ({' or '.join(_ENTRIES[True])}): load it without ema"
            )
        state_dict = checkpoint
    else:
        entry = next((name for name in _ENTRIES[ema] if name in checkpoint), None)
        if entry is None:
            raise ValueError(
                f"{source} has no {' or '.join(repr(n) for n in _ENTRIES[ema])} entry "
                f"(it has {sorted(map(str, checkpoint))})"
            )
        state_dict = checkpoint[entry]
    state_dict = {k: _to_numpy(v) for k, v in state_dict.items()}
    if state_dict and all(k.startswith("module.") for k in state_dict):
        state_dict = {k[len("module.") :]: v for k, v in state_dict.items()}
    return state_dict


def read_state_dict(path: str, *, ema: bool = False) -> dict[str, np.ndarray]:
    """Reads the state dict (or, with `ema`, the EMA state dict) of a checkpoint file."""
    return unwrap(_read_file(path), ema=ema, source=f"checkpoint {path}")


def _write_atomically(path: str, write) -> None:
    """Writes through a temporary file and a rename, so a failure never leaves a partial file."""
    directory = os.path.dirname(path)
    if directory:
        tf.io.gfile.makedirs(directory)
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        with tf.io.gfile.GFile(temporary, "wb") as f:
            write(f)
        tf.io.gfile.rename(temporary, path, overwrite=True)
    finally:
        if tf.io.gfile.exists(temporary):
            tf.io.gfile.remove(temporary)


def save_torch(path: str, payload: dict) -> None:
    """`torch.save` of `payload`, whose numpy arrays (at any dict depth) become tensors."""
    torch = _import_torch(path)

    def convert(value):
        if isinstance(value, dict):
            return {k: convert(v) for k, v in value.items()}
        if isinstance(value, np.ndarray):
            return torch.tensor(value)  # a copy: restored arrays are read-only
        return value

    buffer = io.BytesIO()
    torch.save(convert(payload), buffer)
    _write_atomically(path, lambda f: f.write(buffer.getvalue()))


def save_safetensors(
    path: str, state_dict: dict[str, np.ndarray], metadata: dict[str, str] | None = None
) -> None:
    from safetensors import numpy as safetensors_numpy

    arrays = {k: np.ascontiguousarray(v) for k, v in state_dict.items()}
    data = safetensors_numpy.save(arrays, metadata=metadata)
    _write_atomically(path, lambda f: f.write(data))


def _grid_side(tokens: int, what: str) -> int:
    side = int(round(tokens**0.5))
    if side * side != tokens:
        raise ValueError(f"cannot interpolate {what}: {tokens} tokens are not a square grid")
    return side


def _resize_grid(value: np.ndarray, side: int, method: str) -> np.ndarray:
    """(g*g, ...) tokens -> (side*side, ...) by resampling the g x g grid."""
    old = _grid_side(value.shape[0], "the grid")
    grid = value.reshape((old, old) + value.shape[1:])
    resized = jax.image.resize(grid.astype(np.float32), (side, side) + value.shape[1:], method)
    return np.asarray(resized, value.dtype).reshape((side * side,) + value.shape[1:])


def resize_att_mask(mask: np.ndarray, tokens: int) -> np.ndarray:
    """PAAS mask (heads, N, N) -> (heads, tokens, tokens): bilinear in the query grid and
    in the key grid (a 4-d linear resampling of the mask logits)."""
    heads, old, _ = mask.shape
    side, old_side = _grid_side(tokens, "att_mask"), _grid_side(old, "att_mask")
    grid = mask.reshape(heads, old_side, old_side, old_side, old_side).astype(np.float32)
    resized = jax.image.resize(grid, (heads, side, side, side, side), "linear")
    return np.asarray(resized, mask.dtype).reshape(heads, tokens, tokens)


def resize_pos_embed(pos: np.ndarray, length: int) -> np.ndarray:
    """Position embedding (1, prefix + N, D) -> (1, length, D): the grid part is resampled
    bicubically (timm's `resample_abs_pos_embed` also goes bicubic, with torch's kernel),
    the class-token prefix is kept."""
    for prefix in (0, 1):
        old, new = pos.shape[1] - prefix, length - prefix
        if int(round(old**0.5)) ** 2 == old and int(round(new**0.5)) ** 2 == new:
            grid = _resize_grid(pos[0, prefix:], int(round(new**0.5)), "bicubic")
            return np.concatenate([pos[0, :prefix], grid])[None]
    raise ValueError(
        f"cannot interpolate pos_embed {pos.shape} to {length} tokens: "
        "neither is a square grid with or without a class token"
    )


def _resize_to_targets(state_dict: dict, targets: dict) -> dict:
    """Interpolates the grid-tied parameters whose token count differs from the model's."""
    resized = dict(state_dict)
    for key, target in targets.items():
        if key not in state_dict or target.path[-1] not in GRID_PARAMETERS:
            continue
        value = state_dict[key]
        if value.shape == target.shape:
            continue
        if target.path[-1] == "att_mask":
            resized[key] = resize_att_mask(value, target.shape[-1])
        else:
            resized[key] = resize_pos_embed(value, target.shape[1])
    return resized


class NonFiniteWeightsError(ReportedError, ValueError):
    """A weights file whose tensors hold NaN or infinity."""


def check_finite(state_dict: dict[str, np.ndarray], source: str) -> None:
    """Refuses weights with a value that is not finite, naming the tensors: imported NaNs
    would make the first step non-finite, and an evaluation of them meaningless."""
    bad = [
        key
        for key, value in state_dict.items()
        if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all()
    ]
    if not bad:
        return
    shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
    raise NonFiniteWeightsError(
        f"{source} holds values that are not finite (NaN or infinity) in {len(bad)} of its "
        f"{len(state_dict)} tensors: {shown}. Nothing was trained or evaluated with them. The "
        "file was written after its training diverged, or is damaged: pass an intact file "
        "(an earlier checkpoint of the run that wrote it, or export that run again)."
    )


def _hints(error: str) -> str:
    hints = []
    if f"{HEAD}.weight" in error or f"{HEAD}.bias" in error:
        hints.append("for another number of classes, reset the head (config.init_head='reset')")
    if any(name in error for name in GRID_PARAMETERS):
        hints.append(
            "for another image size, interpolate the grid-tied parameters (config.init_resize=True)"
        )
    return f" Hint: {'; '.join(hints)}." if hints else ""


def load_variables(
    state_dict: dict[str, np.ndarray],
    init_variables: dict,
    *,
    reset_head: bool = False,
    resize: bool = False,
    source: str = "checkpoint",
) -> dict:
    """Official state dict -> {'params', 'batch_stats'} shaped like `init_variables`.

    Strict: every parameter and BatchNorm statistic must come from `state_dict` (a
    ValueError lists all missing, unexpected and wrongly shaped keys; nothing is half
    loaded), and every value finite (`check_finite`). `reset_head` keeps the head of `init_variables` (for another number of
    classes) and ignores the checkpoint's; `resize` interpolates PAAS masks and position
    embeddings trained at another image size.
    """
    init_variables = {
        c: init_variables[c] for c in ("params", "batch_stats") if init_variables.get(c)
    }
    targets = torch_layout.targets_from_flax(init_variables)
    kept = targets
    if reset_head:
        state_dict = {k: v for k, v in state_dict.items() if k.split(".")[0] != HEAD}
        kept = {k: t for k, t in targets.items() if t.path[0] != HEAD}
    check_finite(state_dict, source)
    if resize:
        state_dict = _resize_to_targets(state_dict, kept)
    try:
        loaded = torch_layout.to_flax(state_dict, kept)
    except ValueError as e:
        raise ValueError(f"{source} does not fit the model: {e}.{_hints(str(e))}") from None
    flat = flax.traverse_util.flatten_dict(init_variables)
    flat.update(flax.traverse_util.flatten_dict(loaded))
    return flax.traverse_util.unflatten_dict(flat)


def load_checkpoint(
    path: str,
    init_variables: dict,
    *,
    ema: bool = False,
    reset_head: bool = False,
    resize: bool = False,
) -> dict:
    """`load_variables` of the state dict in file `path` (`ema`: its EMA weights)."""
    return load_variables(
        read_state_dict(path, ema=ema),
        init_variables,
        reset_head=reset_head,
        resize=resize,
        source=f"checkpoint {path}",
    )


def export_state_dict(variables: dict) -> dict[str, np.ndarray]:
    """{'params', 'batch_stats'} (flax names) -> official state dict (keys and layouts)."""
    variables = jax.device_get(
        {c: variables[c] for c in ("params", "batch_stats") if variables.get(c)}
    )
    return torch_layout.to_torch(variables, torch_layout.targets_from_flax(variables))


def init_and_load(
    model,
    path: str,
    *,
    image_size: int = 224,
    ema: bool = False,
    reset_head: bool = False,
    resize: bool = False,
    seed: int = 0,
) -> dict:
    """Variables of `model` (at `image_size`) from checkpoint `path`; a reset head is
    initialised from `seed`."""
    init = functools.partial(model.init, train=False)
    args = (jax.random.PRNGKey(seed), jnp.zeros((1, image_size, image_size, 3), jnp.float32))
    # Only a reset head keeps initial values; otherwise shapes are all that is needed.
    init_variables = jax.jit(init)(*args) if reset_head else jax.eval_shape(init, *args)
    return load_checkpoint(path, init_variables, ema=ema, reset_head=reset_head, resize=resize)


def load_model(
    path: str,
    name: str,
    *,
    num_classes: int = 1000,
    image_size: int = 224,
    ema: bool = False,
    reset_head: bool = False,
    resize: bool = False,
    seed: int = 0,
    **overrides,
) -> tuple[Any, dict]:
    """(registered model `name`, its variables from checkpoint `path`), e.g. a released
    `rspc_rvt_tiny.pth.tar` as `load_model(path, 'rvt_tiny_plus')`."""
    model = models.create(name, num_classes=num_classes, **overrides)
    return model, init_and_load(
        model, path, image_size=image_size, ema=ema, reset_head=reset_head, resize=resize, seed=seed
    )
