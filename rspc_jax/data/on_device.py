"""The last steps of the input pipelines, run on the accelerator: normalising the host's
uint8 batches and timm's random erasing.

The host hands the devices uint8 images (a quarter of float32's bytes to copy, and no
float32 pass over every pixel on the host's cores, which sized the training pipeline's
cost: docs/speed.md, "Input pipeline"). Normalising is a lookup of a 256 x 3 table of the
host's own float32 arithmetic, so that a batch normalised here has the bits it had when
the host normalised it (XLA's own division by 255 and by std rounds differently).

Random erasing (timm `RandomErasing(mode='pixel')`) writes N(0, 1) noise into a box of the
*normalised* image, so it runs here too. The host draws each image's box exactly as before
(`augment.erasing_box`) and a key for its noise; the noise is drawn here from that key, so
the stream stays a pure function of (seed, host, step) however the batch is split over
devices.
"""

import jax
import jax.numpy as jnp
import numpy as np

# The batch fields that carry random erasing: (top, left, height, width) per image, an
# empty box (height or width 0) where it is not erased, and the raw threefry key of its noise.
ERASE_BOX, ERASE_KEY = "erase_box", "erase_key"


def batch_shapes(batch_size: int, image_size: int, random_erase_prob: float) -> dict:
    """{field: (shape, numpy dtype)} of the training batches that the host pipeline
    (`data.train.train_iterator`) yields for the accelerator."""
    shapes = {
        "image": ((batch_size, image_size, image_size, 3), np.uint8),
        "label": ((batch_size,), np.int32),
    }
    if random_erase_prob > 0:
        shapes[ERASE_BOX] = ((batch_size, 4), np.int32)
        shapes[ERASE_KEY] = ((batch_size, 2), np.uint32)
    return shapes


def pixel_table(mean, std) -> np.ndarray:
    """(256, 3) float32: row v, column c is ((v / 255) - mean[c]) / std[c], computed in
    float32 in that order, as the host pipelines compute it."""
    values = np.repeat(np.arange(256, dtype=np.float32)[:, None], 3, axis=1)
    values /= np.float32(255.0)
    values -= np.asarray(mean, np.float32)
    values /= np.asarray(std, np.float32)
    return values


def normalise(images, table):
    """uint8 images (..., 3) -> float32 normalised: `table[images[..., c], c]`."""
    return jnp.asarray(table)[images.astype(jnp.int32), jnp.arange(3)]


def erase(images, boxes, keys):
    """Normalised images (B, H, W, C) with each box (B, 4: top, left, height, width)
    filled by per-pixel, per-channel N(0, 1) noise drawn from its key (B, 2 uint32).
    An empty box leaves its image as it is."""
    height, width = images.shape[1:3]
    rows, cols = jnp.arange(height)[:, None], jnp.arange(width)[None, :]

    def one(image, box, key):
        top, left, h, w = box[0], box[1], box[2], box[3]
        inside = (rows >= top) & (rows < top + h) & (cols >= left) & (cols < left + w)
        noise = jax.random.normal(
            jax.random.wrap_key_data(key, impl="threefry2x32"), image.shape, image.dtype
        )
        return jnp.where(inside[..., None], noise, image)

    return jax.vmap(one)(images, boxes, keys)


def prepared(batch: dict, mean, std):
    """The images of a host batch as the model takes them: uint8 images normalised with
    the dataset's `mean` and `std`, then erased where the batch says so; float images are
    taken as already normalised (tests and benchmarks that make their own batches)."""
    images = batch["image"]
    if images.dtype == jnp.uint8:
        images = normalise(images, pixel_table(mean, std))
    if ERASE_BOX in batch:
        images = erase(images, batch[ERASE_BOX], batch[ERASE_KEY])
    return images
