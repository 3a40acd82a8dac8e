"""Dataset specs and tfds builders: what a dataset is, where it lives, how its records
are read. TF only runs on the host CPU. Nothing here downloads data at run time: a
dataset that is not prepared raises `DatasetNotFoundError` with instructions, except
the digits (`sklearn_digits`, `sklearn_digits_canvas`), built offline from scikit-learn on
first use."""

import dataclasses
import os

from absl import logging
import jax
import tensorflow as tf
import tensorflow_datasets as tfds

from rspc_jax import ConfigError, ReportedError
from rspc_jax.data import sklearn_digits  # noqa: F401  (registers the digits with tfds)

AUTOTUNE = tf.data.AUTOTUNE


def _hide_gpus_from_tf():
    """TF must not reserve accelerator memory that JAX needs."""
    try:
        tf.config.set_visible_devices([], "GPU")
    except RuntimeError:
        logging.warning("TF was initialised before rspc_jax.data; it may see GPUs.")


_hide_gpus_from_tf()


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """What a trainer needs to know about a dataset besides its examples."""

    name: str  # tfds builder name
    num_classes: int
    train_split: str
    eval_split: str
    image_size: int  # default training resolution
    mean: tuple  # per-channel normalisation mean (RGB, [0,1] pixel scale)
    std: tuple
    manual_download: bool
    # Pixel value of an empty background ([0, 1]), where the images have one: the corruption
    # model's selection statistics then report how many chosen patches hold the object.
    background: float | None = None


# Datasets built from a package on first use (no download).
_OFFLINE = ("sklearn_digits", "sklearn_digits_canvas")

# Digits: grey pixel mean/std of the 1500 training images after the builder's
# 0..255 scaling (nearest upsampling leaves them unchanged), on all 3 channels.
_SPECS = {
    "sklearn_digits": DatasetSpec(
        name="sklearn_digits",
        num_classes=10,
        train_split="train",
        eval_split="test",
        image_size=32,
        mean=(0.3052,) * 3,
        std=(0.3749,) * 3,
        manual_download=False,
        background=0.0,
    ),
    "cifar10": DatasetSpec(
        name="cifar10",
        num_classes=10,
        train_split="train",
        eval_split="test",
        image_size=32,
        mean=(0.4914, 0.4822, 0.4465),
        std=(0.2470, 0.2435, 0.2616),
        manual_download=False,
    ),
    "cifar100": DatasetSpec(
        name="cifar100",
        num_classes=100,
        train_split="train",
        eval_split="test",
        image_size=32,
        mean=(0.5071, 0.4865, 0.4409),
        std=(0.2673, 0.2564, 0.2762),
        manual_download=False,
    ),
    "imagenet2012": DatasetSpec(
        name="imagenet2012",
        num_classes=1000,
        train_split="train",
        eval_split="validation",
        image_size=224,
        mean=(0.485, 0.456, 0.406),
        std=(0.229, 0.224, 0.225),
        manual_download=True,
    ),
}

# The same digits on a 16x16 canvas (mean and std of its 1500 training images).
_SPECS["sklearn_digits_canvas"] = dataclasses.replace(
    _SPECS["sklearn_digits"], name="sklearn_digits_canvas", mean=(0.0763,) * 3, std=(0.2293,) * 3
)

# Files that the manual-download datasets expect in <data_dir>/downloads/manual.
_MANUAL_FILES = {
    "imagenet2012": "ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar",
}


def dataset_spec(name: str) -> DatasetSpec:
    """Returns the spec of a supported dataset; ValueError names the others."""
    if name not in _SPECS:
        raise ConfigError(f"Unknown dataset {name!r}; known datasets: {sorted(_SPECS)}.")
    return _SPECS[name]


class DatasetNotFoundError(ReportedError, FileNotFoundError):
    """A dataset is not prepared in the data_dir; the message says how to fix it."""


def _preparation_instructions(name: str, data_dir: str, manual: bool) -> str:
    """How to prepare `name` offline, since this project never downloads."""
    build = f"`tfds build {name} --data_dir={data_dir}`"
    if manual:
        files = _MANUAL_FILES.get(name, "the files in the builder's manual download instructions")
        how = f"put {files} in {data_dir}/downloads/manual/ and run {build}"
    else:
        how = (
            f"on a machine with internet run {build} (or copy an existing "
            f"tensorflow_datasets/{name} directory into {data_dir})"
        )
    return (
        f"Dataset {name!r} is not prepared in data_dir {data_dir!r}, and "
        f"rspc_jax never downloads data at run time. To prepare it, {how}. "
        f"Then point runs at it with TFDS_DATA_DIR={data_dir} or "
        f"--config.data_dir={data_dir}."
    )


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
    raise DatasetNotFoundError(_preparation_instructions(name, data_dir, manual))


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
