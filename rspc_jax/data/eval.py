"""The evaluation readers: every example of a split on exactly one host, after the
dataset's eval preprocessing, as uint8 images (the robustness suites corrupt pixels
before normalising); then host-side batches, padded and masked so that every host yields
the same number and each example counts once, normalised on the host or left uint8 for
the accelerator to normalise (the evaluation loop's path)."""

from collections.abc import Callable, Iterable, Iterator

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from rspc_jax.data import options
from rspc_jax.data.records import (
    AUTOTUNE,
    deterministic,
    encoded_records,
    get_builder,
    image_decoder,
    num_examples_of,
    process_or_default,
)

# ----------------------------------------------------------------------------
# Preprocessing: fn(uint8 RGB image, [key,] size) -> float32 in [0, 255]
# ----------------------------------------------------------------------------


def digits(image, size):
    """Nearest upsampling keeps the digits' pixels sharp and their statistics."""
    return tf.image.resize(image, [size, size], method="nearest")


def cifar(image, size):
    """Identity at 32 px; bilinear (antialiased) resize otherwise."""
    return tf.image.resize(image, [size, size], method="bilinear", antialias=True)


def imagenet(image, size):
    """Shorter side to size/0.875 (bicubic), then the central size x size crop."""
    shorter = int(size / 0.875)
    hw = tf.cast(tf.shape(image)[:2], tf.float32)
    new_hw = tf.cast(tf.round(hw * shorter / tf.reduce_min(hw)), tf.int32)
    image = tf.image.resize(image, tf.maximum(new_hw, size), method="bicubic")
    offset = (tf.shape(image)[:2] - size) // 2
    image = tf.slice(image, [offset[0], offset[1], 0], [size, size, 3])
    return tf.clip_by_value(image, 0.0, 255.0)


EVAL_PREPROCESS = {
    "sklearn_digits": digits,
    "sklearn_digits_canvas": digits,
    "sklearn_digits_textured": digits,
    "cifar10": cifar,
    "cifar100": cifar,
    "imagenet2012": imagenet,
}

# The eval_preprocess choices besides '' (the dataset's default), named in options.
EVAL_CHOICES = {
    "center_crop": imagenet,
}


def _host_records(builder, split, process_index, process_count):
    """(this host's encoded records of `split`, the largest host's count): every
    example on exactly one host."""
    process_index, process_count = process_or_default(process_index, process_count)
    host_splits = tfds.even_splits(split, n=process_count)
    largest = max(
        num_examples_of(encoded_records(builder, host_split)) for host_split in host_splits
    )
    return encoded_records(builder, host_splits[process_index]), largest


def eval_preprocess_fn(dataset: str, eval_preprocess: str = ""):
    """The eval preprocessing of `dataset`, or the named `eval_preprocess` choice."""
    options.check_eval_preprocess(eval_preprocess)
    return EVAL_CHOICES[eval_preprocess] if eval_preprocess else EVAL_PREPROCESS[dataset]


def crop_only(image, size):
    """The ImageNet-C/-P protocol (RVT, RSPC, Hendrycks): the released images are
    already 224 x 224 crops, so only CenterCrop(size) (the identity at 224); images
    smaller than `size` are first resized up (bicubic)."""
    hw = tf.shape(image)[:2]
    scale = tf.maximum(1.0, size / tf.cast(tf.reduce_min(hw), tf.float32))
    image = tf.cast(image, tf.float32)
    if_smaller = tf.cast(tf.math.ceil(tf.cast(hw, tf.float32) * scale), tf.int32)
    image = tf.cond(
        scale > 1.0, lambda: tf.image.resize(image, if_smaller, method="bicubic"), lambda: image
    )
    offset = (tf.shape(image)[:2] - size) // 2
    return tf.slice(image, [offset[0], offset[1], 0], [size, size, 3])


def as_uint8(image, size):
    """Rounded to uint8 with the static shape that batching needs, as saving the
    preprocessed image would do (ImageNet-C's JPEGs) and as PIL holds a crop (timm's
    training transforms): the robustness suites corrupt pixels before normalising, and the
    accelerator normalises both pipelines' batches."""
    image = tf.clip_by_value(tf.round(tf.cast(image, tf.float32)), 0.0, 255.0)
    return tf.ensure_shape(tf.cast(image, tf.uint8), [size, size, 3])


def eval_examples(
    *,
    dataset: str,
    data_dir: str | None,
    split: str,
    image_size: int,
    eval_preprocess: str = "",
    builder_name: str | None = None,
    preprocess=None,
    process_index: int | None = None,
    process_count: int | None = None,
) -> tuple[tf.data.Dataset, int]:
    """This host's share of `split` as unbatched {'image': uint8 (size, size, 3),
    'label'} after the eval preprocessing, and the largest host's example count.

    `builder_name` reads another tfds dataset (e.g. `imagenet_r`) with the
    preprocessing of `dataset` (or `preprocess`, fn(image, size)).
    """
    preprocess = preprocess or eval_preprocess_fn(dataset, eval_preprocess)
    builder = get_builder(builder_name or dataset, data_dir)
    records, largest = _host_records(builder, split, process_index, process_count)
    decode = image_decoder(builder)

    def prepare(ex):
        return {
            "image": as_uint8(preprocess(decode(ex["image"]), image_size), image_size),
            "label": ex["label"],
        }

    return deterministic(records.map(prepare, num_parallel_calls=AUTOTUNE)), largest


def host_share(
    count: int, process_index: int | None = None, process_count: int | None = None
) -> tuple[slice, int]:
    """This host's contiguous rows of `count` (as tfds.even_splits), the largest share."""
    process_index, process_count = process_or_default(process_index, process_count)
    bounds = np.linspace(0, count, process_count + 1).round().astype(int)
    return (slice(bounds[process_index], bounds[process_index + 1]), int(np.diff(bounds).max()))


def file_examples(
    paths,
    labels,
    *,
    image_size: int,
    preprocess,
    process_index: int | None = None,
    process_count: int | None = None,
) -> tuple[tf.data.Dataset, int]:
    """Image files (JPEG/PNG, e.g. ImageNet-C/A/R folders) as eval_examples does."""
    rows, largest = host_share(len(paths), process_index, process_count)

    def load(path, label):
        image = tf.io.decode_image(tf.io.read_file(path), channels=3, expand_animations=False)
        return {
            "image": as_uint8(preprocess(image, image_size), image_size),
            "label": tf.cast(label, tf.int32),
        }

    ds = tf.data.Dataset.from_tensor_slices((np.asarray(paths)[rows], np.asarray(labels)[rows]))
    return deterministic(ds.map(load, num_parallel_calls=AUTOTUNE)), largest


def array_examples(
    images: np.ndarray,
    labels: np.ndarray,
    *,
    image_size: int,
    preprocess,
    process_index: int | None = None,
    process_count: int | None = None,
) -> tuple[tf.data.Dataset, int]:
    """uint8 image arrays (CIFAR-C's .npy files) as eval_examples does."""
    rows, largest = host_share(len(images), process_index, process_count)

    def prepare(image, label):
        return {
            "image": as_uint8(preprocess(image, image_size), image_size),
            "label": tf.cast(label, tf.int32),
        }

    ds = tf.data.Dataset.from_tensor_slices((images[rows], labels[rows]))
    return deterministic(ds.map(prepare, num_parallel_calls=AUTOTUNE)), largest


# transform(uint8 images (n, H, W, 3), labels (n,)) -> uint8 images (n, H, W, 3)
Transform = Callable[[np.ndarray, np.ndarray], np.ndarray]


def num_batches(largest_host_count: int, local_batch: int, limit: int = 0) -> int:
    """Batches per host so that the host with the most examples sees all of them
    (`limit` > 0 caps the examples per host)."""
    count = min(largest_host_count, limit) if limit else largest_host_count
    return -(-count // local_batch)


def host_batches(
    examples: Iterable[tuple[np.ndarray, int]],
    *,
    local_batch: int,
    batches: int,
    image_shape: tuple[int, int, int],
    mean,
    std,
    transform: Transform | None = None,
    limit: int = 0,
    normalise: bool = True,
) -> Iterator[dict]:
    """Exactly `batches` dicts {'image' float32 normalised, 'label' int32, 'mask' float32};
    examples past `limit` (> 0) are dropped, missing ones are zero images with mask 0, so
    every example counts once and all hosts run the same number of collective steps.

    `normalise=False` yields the uint8 images (after `transform`) for the accelerator to
    normalise (`on_device.normalise`, the same bits): a quarter of the bytes to send, and no 4-byte-per-pixel
    batch to allocate and fill on the host (docs/speed.md, "Input pipeline")."""
    mean = np.asarray(mean, np.float32)
    std = np.asarray(std, np.float32)
    iterator = iter(examples)
    taken = 0
    for _ in range(batches):
        raw = np.zeros((local_batch, *image_shape), np.uint8)
        labels = np.zeros(local_batch, np.int32)
        count = 0
        while count < local_batch and (not limit or taken < limit):
            try:
                image, label = next(iterator)
            except StopIteration:
                break
            if np.shape(image) != raw.shape[1:]:
                raise ValueError(
                    f"an evaluation example of shape {np.shape(image)} in batches of "
                    f"{raw.shape[1:]} images: the source and image_shape disagree"
                )
            raw[count], labels[count] = image, label
            count += 1
            taken += 1
        if count and transform is not None:
            raw[:count] = _uint8(transform(raw[:count], labels[:count]))
        mask = np.zeros(local_batch, np.float32)
        mask[:count] = 1.0
        pixels = _normalised_and_padded(raw, count, mean, std) if normalise else raw
        yield {"image": pixels, "label": labels, "mask": mask}


def _uint8(images) -> np.ndarray:
    if np.asarray(images).dtype != np.uint8:
        raise TypeError(
            f"an evaluation transform returned {np.asarray(images).dtype} images; it must "
            "return uint8 pixels (round and clip to 0-255 first), as the batch it fills is uint8"
        )
    return images


def _normalised_and_padded(raw, count, mean, std) -> np.ndarray:
    """The batch's first `count` uint8 images normalised into a zeroed float32 batch. In
    place, one buffer: a batch of 224 px images is 38 MB of float32, and a new array per
    arithmetic step cost the evaluation's host more than decoding."""
    pixels = np.zeros(raw.shape, np.float32)
    if count:
        real = pixels[:count]
        real[...] = raw[:count]  # exact: uint8 -> float32
        real /= np.float32(255.0)
        real -= mean
        real /= std
    return pixels
