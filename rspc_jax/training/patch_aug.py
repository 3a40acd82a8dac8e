"""RVT*'s patch-wise augmentation (RVT, Mao et al. 2022; RSPC_RVT `engine.py` patch_level_aug),
on device.

Every non-overlapping patch of the normalised batch independently gets, each with
probability 0.1: a random resized crop (a square of 85-100 % of the patch area, resampled
bilinearly back to the patch size), Gaussian noise (std 0.01 in normalised units) and a
horizontal flip, in that order; the batch is then clamped to the normalised pixel range.
Written by hand because no JAX library augments per patch (the official code uses kornia
on the unfolded patches); the bilinear resampling is not kornia's bit for bit.
"""

import jax
import jax.numpy as jnp

PROB = 0.1
CROP_SCALE = (0.85, 1.0)
NOISE_STD = 0.01


def to_patches(images: jax.Array, patch_size: int) -> jax.Array:
    """(B, H, W, C) -> (B * H/p * W/p, p, p, C), patches in row-major token order."""
    batch, height, width, channels = images.shape
    grid_h, grid_w = height // patch_size, width // patch_size
    x = images.reshape(batch, grid_h, patch_size, grid_w, patch_size, channels)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(-1, patch_size, patch_size, channels)


def from_patches(patches: jax.Array, image_shape) -> jax.Array:
    batch, height, width, channels = image_shape
    size = patches.shape[1]
    x = patches.reshape(batch, height // size, width // size, size, size, channels)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(image_shape)


def _interpolation_matrix(offset: jax.Array, side: jax.Array, size: int) -> jax.Array:
    """(n, size, size) bilinear weights sampling `size` points of [offset, offset + side]
    (pixel centres, align_corners=False) from a row of `size` pixels."""
    centres = offset[:, None] + (jnp.arange(size) + 0.5) * (side[:, None] / size) - 0.5
    centres = jnp.clip(centres, 0.0, size - 1.0)
    return jnp.maximum(0.0, 1.0 - jnp.abs(centres[:, :, None] - jnp.arange(size)))


def random_resized_crop(rng: jax.Array, patches: jax.Array) -> jax.Array:
    """A random square crop of area fraction U(CROP_SCALE) of each patch, resized back."""
    count, size = patches.shape[:2]
    scale_key, offset_key = jax.random.split(rng)
    side = size * jnp.sqrt(
        jax.random.uniform(scale_key, (count,), minval=CROP_SCALE[0], maxval=CROP_SCALE[1])
    )
    offsets = jax.random.uniform(offset_key, (count, 2)) * (size - side)[:, None]
    rows = _interpolation_matrix(offsets[:, 0], side, size)
    cols = _interpolation_matrix(offsets[:, 1], side, size)
    return jnp.einsum("nij,njkc,nlk->nilc", rows, patches, cols).astype(patches.dtype)


def patch_augment(
    rng: jax.Array,
    images: jax.Array,
    patch_size: int,
    lower: jax.Array | None = None,
    upper: jax.Array | None = None,
):
    """The augmented batch; `lower`/`upper` (per channel) clamp it when given."""
    patches = to_patches(images, patch_size)
    count = patches.shape[0]
    keys = jax.random.split(rng, 5)
    apply = [jax.random.bernoulli(k, PROB, (count, 1, 1, 1)) for k in keys[:3]]
    patches = jnp.where(apply[0], random_resized_crop(keys[3], patches), patches)
    noise = NOISE_STD * jax.random.normal(keys[4], patches.shape, patches.dtype)
    patches = jnp.where(apply[1], patches + noise, patches)
    patches = jnp.where(apply[2], patches[:, :, ::-1], patches)
    out = from_patches(patches, images.shape)
    if lower is not None:
        out = jnp.clip(out, jnp.asarray(lower), jnp.asarray(upper))
    return out
