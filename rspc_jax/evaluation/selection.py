"""How the corruption model C selects patches: statistics of its occlusion masks.

The paper's C picks, per image, the patches that matter most to attention (Sec. 3.2,
Fig. 6). A C that has collapsed to one fixed mask for every image is no longer that
adversary, so training logs and evaluation reports these numbers:

- `distinct_masks`: how many different masks the images got;
- `entropy` (`selection_entropy`): the mean over positions of the binary entropy of each
  position's selection frequency, divided by its value when every position is chosen equally
  often (the same number of patches per image): 1 = uniform use of positions (random
  selection), 0 = every image gets the same mask;
- `mask_iou`: the mean intersection-over-union of the masks of two different images
  (1 = identical masks; random masks of k of n patches give about k / (2n - k));
- `modal_mask_share`: the fraction of images whose mask is the most common one (1 = one
  mask for every image; unlike a comparison with C's mask of a blank image it needs no
  blank image and no tie-free scores);
- `on_object`: the fraction of selected patches that hold part of the object, for datasets
  whose spec says which pixels are the object (`rspc.object_patches`; digits: a patch with any
  stroke pixel);
- `frequency`: how often each position was selected (a vector, row-major over the patch grid;
  the training log keeps it so that a run's selection can be drawn over training).

Pure jnp functions (they run inside the train step and on host arrays alike).
"""

import jax.numpy as jnp


def _binary_entropy(p):
    p = jnp.clip(p, 1e-7, 1 - 1e-7)
    return -(p * jnp.log(p) + (1 - p) * jnp.log1p(-p))


def _same_masks(occluded) -> jnp.ndarray:
    """(B, B) True where two rows of `occluded` are equal."""
    return jnp.all(occluded[:, None, :] == occluded[None, :, :], axis=-1)


def distinct_masks(occluded) -> jnp.ndarray:
    """The number of different rows of `occluded` (B, N)."""
    earlier_copy = jnp.any(jnp.tril(_same_masks(occluded), k=-1), axis=1)
    return jnp.sum(~earlier_copy)


def modal_mask_share(occluded) -> jnp.ndarray:
    """The fraction of rows of `occluded` (B, N) equal to its most common row."""
    return jnp.max(jnp.sum(_same_masks(occluded), axis=1)) / occluded.shape[0]


def selection_entropy(occluded) -> jnp.ndarray:
    """Mean binary entropy of the per-position frequencies, normalised (module docstring)."""
    occluded = occluded.astype(jnp.float32)
    frequency = occluded.mean(axis=0)
    uniform = _binary_entropy(occluded.mean())
    return _binary_entropy(frequency).mean() / uniform


def mask_iou(occluded) -> jnp.ndarray:
    """Mean IoU of the masks of two different images (1.0 for a single image)."""
    occluded = occluded.astype(jnp.float32)
    count = occluded.shape[0]
    intersection = occluded @ occluded.T
    sizes = occluded.sum(axis=1)
    union = sizes[:, None] + sizes[None, :] - intersection
    iou = jnp.where(union > 0, intersection / jnp.maximum(union, 1.0), 1.0)
    pairs = float(count * (count - 1))  # a float: an int32 overflows past 46,341 images
    return jnp.where(pairs > 0, (iou.sum() - jnp.trace(iou)) / max(pairs, 1.0), 1.0)


def statistics(occluded, on_object=None) -> dict:
    """The module docstring's numbers for masks `occluded` (B, N; 1 = occluded)."""
    stats = dict(
        frequency=occluded.astype(jnp.float32).mean(axis=0),
        distinct_masks=distinct_masks(occluded).astype(jnp.float32),
        modal_mask_share=modal_mask_share(occluded),
        entropy=selection_entropy(occluded),
        mask_iou=mask_iou(occluded),
    )
    if on_object is not None:
        selected = occluded.astype(jnp.float32)
        stats["on_object"] = (selected * on_object).sum() / jnp.maximum(selected.sum(), 1.0)
    return stats
