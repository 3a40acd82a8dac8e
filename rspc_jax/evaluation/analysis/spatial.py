"""The spatial grid attack of Engstrom et al. (2019) as Bhojanapalli et al. run it: every
combination of horizontal and vertical translations and rotations on a grid; an example
is robust only if every transformed image is classified correctly. Empty space is black
(pixel value 0)."""

import itertools

import dm_pix
import jax
import jax.numpy as jnp
import numpy as np


def grid(
    max_translation: float, translations: int, max_rotation: float, rotations: int
) -> np.ndarray:
    """(G, 3) rows (dy px, dx px, angle degrees), equally spaced in the closed ranges; a
    count of 1 means 0 only."""

    def values(limit, count):
        return np.linspace(-limit, limit, count) if count > 1 else np.zeros(1)

    shifts, angles = values(max_translation, translations), values(max_rotation, rotations)
    return np.asarray(list(itertools.product(shifts, shifts, angles)), np.float32)


def transform(images: jax.Array, point: jax.Array) -> jax.Array:
    """Rotates (about the centre) and translates NHWC `images` in pixel space, bilinear,
    filling with 0."""
    height, width = images.shape[1:3]
    dy, dx, degrees = point[0], point[1], point[2]
    theta = jnp.deg2rad(degrees)
    cos, sin = jnp.cos(theta), jnp.sin(theta)
    # output = R (input - c) + c + t  =>  input = R^T (output - c - t) + c
    inverse = jnp.array([[cos, sin, 0.0], [-sin, cos, 0.0], [0.0, 0.0, 1.0]])
    centre = jnp.array([(height - 1) / 2, (width - 1) / 2, 0.0])
    offset = centre - inverse @ (centre + jnp.stack([dy, dx, 0.0]))
    return jax.vmap(
        lambda image: dm_pix.affine_transform(
            image, inverse, offset=offset, order=1, mode="constant", cval=0.0
        )
    )(images)
