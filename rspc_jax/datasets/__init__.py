"""Project TFDS builders; importing this package registers them with tfds."""

from rspc_jax.datasets import sklearn_digits  # noqa: F401  (registers `sklearn_digits`)
