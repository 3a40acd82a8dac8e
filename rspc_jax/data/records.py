"""The tfds side of the datasets: prepared builders (never a download: the digits build
offline from scikit-learn on first use, any other missing dataset raises
`specs.DatasetNotFoundError` with instructions) and their encoded records. TF only runs
on the host CPU."""

import os

from absl import logging
import jax
import tensorflow as tf
import tensorflow_datasets as tfds

from rspc_jax.data import sklearn_digits  # noqa: F401  (registers the digits with tfds)
from rspc_jax.data.specs import DatasetNotFoundError, preparation_instructions

AUTOTUNE = tf.data.AUTOTUNE

# Datasets built from a package on first use (no download).
_OFFLINE = ("sklearn_digits", "sklearn_digits_canvas", "sklearn_digits_textured")


def _hide_gpus_from_tf():
    """TF must not reserve accelerator memory that JAX needs."""
    try:
        tf.config.set_visible_devices([], "GPU")
    except RuntimeError:
        logging.warning("TF was initialised before rspc_jax.data.records; it may see GPUs.")


_hide_gpus_from_tf()


def _resolve_data_dir(data_dir: str | None) -> str:
    return data_dir or os.environ.get("TFDS_DATA_DIR") or tfds.core.constants.DATA_DIR


def _tfds_is_mocked() -> bool:
    """Under `tfds.testing.mock_data` nothing is on disk by design."""
    prepare = tfds.core.DatasetBuilder.download_and_prepare
    return prepare.__module__.startswith("tensorflow_datasets.testing")


def get_builder(name: str, data_dir: str | None) -> tfds.core.DatasetBuilder:
    """Returns the prepared builder of `name`; never downloads.

    The digits are prepared on first use (they need no network); any other
    dataset that is missing raises `DatasetNotFoundError`.
    """
    data_dir = _resolve_data_dir(data_dir)
    builder = tfds.builder(name, data_dir=data_dir)
    if builder.is_prepared() or _tfds_is_mocked():
        return builder
    if name in _OFFLINE:
        builder.download_and_prepare()
        return builder
    manual = bool(builder.MANUAL_DOWNLOAD_INSTRUCTIONS)
    raise DatasetNotFoundError(preparation_instructions(name, data_dir, manual))


# ----------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------


def process_or_default(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    if process_index is None:
        process_index = jax.process_index()
    if process_count is None:
        process_count = jax.process_count()
    return process_index, process_count


def encoded_records(builder, split) -> tf.data.Dataset:
    """{'image': encoded bytes, 'label': int32} in on-disk order.

    Images stay encoded so that skipping and shuffling records is cheap; they
    are decoded by `image_decoder` after the skip.
    """
    ds = builder.as_dataset(
        split=split,
        shuffle_files=False,
        decoders={"image": tfds.decode.SkipDecoding()},
        read_config=tfds.ReadConfig(try_autocache=False, skip_prefetch=True),
    )
    return ds.map(lambda ex: {"image": ex["image"], "label": tf.cast(ex["label"], tf.int32)})


def image_decoder(builder):
    """Returns fn(encoded) -> uint8 RGB image (grey images repeated x3)."""
    feature = builder.info.features["image"]

    def decode(encoded):
        image = feature.decode_example(encoded)
        if image.shape[-1] == 1:
            image = tf.image.grayscale_to_rgb(image)
        return image

    return decode


def num_examples_of(ds: tf.data.Dataset) -> int:
    """tfds datasets know their size; under mock_data it is the mocked count."""
    return int(ds.cardinality())


def num_examples(*, dataset: str, data_dir: str | None, split: str) -> int:
    """Examples in `split` of `dataset` (all hosts together)."""
    return num_examples_of(encoded_records(get_builder(dataset, data_dir), split))


def deterministic(ds: tf.data.Dataset) -> tf.data.Dataset:
    options = tf.data.Options()
    options.deterministic = True
    return ds.with_options(options)
