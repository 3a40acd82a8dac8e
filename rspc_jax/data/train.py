"""The training reader: per-host shards, deterministic and cheaply resumable.

Training streams are a pure function of (seed, host, step): epoch `e` is the
host shard reshuffled with a seed derived from (seed, host, e), and every
example is augmented with stateless random ops keyed by (seed, host, e, index
in the shard). Resuming at `start_step` therefore only skips encoded records of
the current epoch and never decodes a skipped record (with repeated augmentation,
the copies before the resume point of the record it falls in are augmented and
dropped). The DeiT/timm augmentations (RandAugment, random erasing, repeated
augmentation) live in `rspc_jax.data.augment` and `_epoch_stream` and follow the
same rule; a record's repeated copies are decoded once. The host's batches are uint8:
normalising and random erasing's noise run on the accelerator (`rspc_jax.data.on_device`),
where they cost the host's cores nothing (docs/speed.md, "Input pipeline").
"""

from collections.abc import Iterator
import functools

import tensorflow as tf
import tensorflow_datasets as tfds

from rspc_jax.data import augment as augment_lib
from rspc_jax.data import eval as eval_lib
from rspc_jax.data import on_device
from rspc_jax.data import options as data_options
from rspc_jax.data.records import (
    AUTOTUNE,
    deterministic,
    encoded_records,
    get_builder,
    image_decoder,
    num_examples_of,
    process_or_default,
)
from rspc_jax.data.specs import dataset_spec


def recipe_args(config) -> dict:
    """The augmentation recipe of a run's config as `train_iterator`'s keyword arguments: the
    training loop and the input-pipeline benchmark read the same recipe from one place."""
    return dict(
        augment=config.augment,
        shuffle_buffer=config.shuffle_buffer,
        rand_augment=config.rand_augment,
        random_erase_prob=config.random_erase_prob,
        repeated_augment=config.repeated_augment,
        color_jitter=config.color_jitter,
        crop_area=tuple(config.crop_area) or None,
        crop_aspect=tuple(config.crop_aspect) or None,
    )


def _random_translate(image, key, size, pad):
    """Shift by up to +-pad pixels in each direction, filling with zeros."""
    padded = tf.pad(image, [[pad, pad], [pad, pad], [0, 0]])
    return tf.image.stateless_random_crop(padded, [size, size, 3], seed=key)


def _train_digits(image, key, size):
    """Upsample, then shift by up to +-1 original pixel (size/8 px)."""
    image = eval_lib.digits(image, size)
    return _random_translate(image, key, size, pad=round(size / 8))


def _train_cifar(image, key, size):
    """Random crop with 4 px zero padding (at 32 px) and horizontal flip."""
    crop_key, flip_key = tf.unstack(tf.random.experimental.stateless_split(key))
    image = eval_lib.cifar(image, size)
    image = _random_translate(image, crop_key, size, pad=round(4 * size / 32))
    return tf.image.stateless_random_flip_left_right(image, flip_key)


def _train_imagenet(image, key, size, area=(0.08, 1.0), aspect=(3 / 4, 4 / 3)):
    """Inception crop (area 8-100%, aspect 3/4-4/3 by default), bicubic resize, flip."""
    crop_key, flip_key = tf.unstack(tf.random.experimental.stateless_split(key))
    begin, crop_size, _ = tf.image.stateless_sample_distorted_bounding_box(
        tf.shape(image),
        bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]),
        seed=crop_key,
        min_object_covered=0.0,
        aspect_ratio_range=tuple(aspect),
        area_range=tuple(area),
        max_attempts=10,
        use_image_if_no_bounding_boxes=True,
    )
    image = tf.slice(image, begin, crop_size)
    image = tf.image.resize(image, [size, size], method="bicubic")
    image = tf.clip_by_value(image, 0.0, 255.0)
    return tf.image.stateless_random_flip_left_right(image, flip_key)


_AUGMENTS = {
    "digits": _train_digits,
    "cifar": _train_cifar,
    "imagenet": _train_imagenet,
}


def _train_preprocess(augment: str, dataset: str, crop_area=None, crop_aspect=None):
    """Returns fn(image, key, size); 'none' is the dataset's eval preprocessing.
    `crop_area` / `crop_aspect` replace the 'imagenet' crop's ranges."""
    if augment == "none":
        eval_fn = eval_lib.EVAL_PREPROCESS[dataset]
        return lambda image, key, size: eval_fn(image, size)
    if augment not in _AUGMENTS:
        raise ValueError(
            f"Unknown augment {augment!r}; choose one of {sorted([*_AUGMENTS, 'none'])}."
        )
    if augment == "imagenet" and (crop_area or crop_aspect):
        return functools.partial(
            _train_imagenet, area=crop_area or (0.08, 1.0), aspect=crop_aspect or (3 / 4, 4 / 3)
        )
    return _AUGMENTS[augment]


# ----------------------------------------------------------------------------
# Iterators
# ----------------------------------------------------------------------------


def _epoch_stream(records, host_key, start_epoch, shuffle_buffer, repeats=1):
    """Infinite stream of (copy keys (repeats, 2), record), starting at `start_epoch`.

    Each epoch is reshuffled with a seed derived from (host_key, epoch) and each
    record is keyed by (host_key, epoch, index in the shard), so the stream does
    not depend on where it was started.

    `repeats` > 1 is DeiT's repeated augmentation (RASampler): every record is
    emitted `repeats` times in a row (`train_iterator` decodes it once and augments
    each copy), copy r keyed by fold_in(record key, r) so that the copies are
    augmented differently, and an epoch of the stream has `repeats` x the shard's
    records. Consecutive copies land in the same batch (except where they straddle
    a batch boundary), as RASampler sends them to neighbouring GPUs of the same
    step. RASampler takes the first 1/repeats of a fresh permutation every training
    epoch; here one permutation is consumed over `repeats` training epochs instead,
    so each of those still holds about N / repeats records x repeats copies, but no
    record is skipped however small the shuffle buffer (taking the first third of a
    buffered shuffle would mostly see the first third of the on-disk order).
    """
    fold_in = tf.random.experimental.stateless_fold_in

    def copy_keys(key):
        if repeats == 1:
            return key[None]
        return tf.stack([fold_in(key, r) for r in range(repeats)])

    def one_epoch(epoch):
        epoch_key = fold_in(host_key, epoch)
        shuffle_seed = tf.random.stateless_uniform(
            [], seed=epoch_key, minval=None, maxval=None, dtype=tf.int64
        )
        shuffled = records.enumerate().shuffle(shuffle_buffer, seed=shuffle_seed)
        return shuffled.map(lambda index, ex: (copy_keys(fold_in(epoch_key, index)), ex))

    return tf.data.Dataset.counter(start_epoch).flat_map(one_epoch)


def _augmenter(preprocess, image_size, color_jitter, rand_augment, random_erase_prob):
    """One decoded image and its key -> one augmented copy (timm's order): the uint8 crop
    and, with erasing, its box and noise key (the accelerator normalises and erases)."""
    fold_in = tf.random.experimental.stateless_fold_in

    def augmented(image, key):
        image = preprocess(image, key, image_size)
        if color_jitter > 0:
            image = augment_lib.color_jitter(image, fold_in(key, 3), color_jitter)
        if rand_augment:
            image = augment_lib.rand_augment(image, fold_in(key, 1), rand_augment)
        copy = {"image": eval_lib.as_uint8(image, image_size)}
        if random_erase_prob > 0:
            copy[on_device.ERASE_BOX], copy[on_device.ERASE_KEY] = augment_lib.erasing_box(
                (image_size, image_size, 3), fold_in(key, 2), random_erase_prob
            )
        return copy

    return augmented


def train_iterator(
    *,
    dataset: str,
    data_dir: str | None,
    split: str,
    image_size: int,
    local_batch_size: int,
    seed: int,
    start_step: int = 0,
    augment: str,
    shuffle_buffer: int = 10_000,
    rand_augment: str = "",
    random_erase_prob: float = 0.0,
    repeated_augment: int = 1,
    color_jitter: float = 0.0,
    crop_area=None,
    crop_aspect=None,
    process_index: int | None = None,
    process_count: int | None = None,
) -> Iterator[dict]:
    """Yields this host's training batches forever, starting at `start_step`.

    Batches (`on_device.batch_shapes`): {'image': uint8 (local_batch_size, image_size,
    image_size, 3), 'label': int32 (local_batch_size,)}, and with random erasing each
    image's box and noise key; `on_device.prepared` makes the normalised, erased images
    of them on the accelerator (the train step does).
    The batch at step s is bitwise the same whether the iterator started at 0
    and was advanced s times or started at `start_step=s`. Each host reads its
    own equal-sized shard of `split` (the remainder is dropped).

    The order is timm's create_transform: `augment` (crop, flip; `crop_area`,
    `crop_aspect` ranges of the 'imagenet' crop), then colour jitter
    `color_jitter` (0 = off) or RandAugment `rand_augment` ('' = off, e.g.
    'rand-m9-mstd0.5-inc1') on the crop, normalisation, then random erasing
    with `random_erase_prob` (the last two on the accelerator).
    `repeated_augment` > 1 emits every record that many times in a row, with
    different augmentations (`_epoch_stream`).
    """
    data_options.check_augmentation(
        rand_augment=rand_augment,
        random_erase_prob=random_erase_prob,
        repeated_augment=repeated_augment,
    )
    dataset_spec(dataset)  # an unknown name fails here, before anything is read
    preprocess = _train_preprocess(augment, dataset, crop_area, crop_aspect)
    builder = get_builder(dataset, data_dir)
    process_index, process_count = process_or_default(process_index, process_count)
    host_split = tfds.split_for_jax_process(
        split, process_index=process_index, process_count=process_count, drop_remainder=True
    )
    records = encoded_records(builder, host_split)
    epoch_size = num_examples_of(records)
    if epoch_size <= 0:
        raise ValueError(
            f"Host {process_index} of {process_count} has no examples of {dataset} split {split!r}."
        )
    repeats = int(repeated_augment)
    start_epoch, offset = divmod(start_step * local_batch_size, epoch_size * repeats)
    host_key = tf.constant([seed, process_index], tf.int64)
    decode = image_decoder(builder)
    augmented = _augmenter(preprocess, image_size, color_jitter, rand_augment, random_erase_prob)

    def prepare(keys, ex):
        """The record's copies: decoded once, each copy augmented with its own key."""
        image = decode(ex["image"])
        copies = [augmented(image, keys[r]) for r in range(repeats)]
        stacked = {name: tf.stack([c[name] for c in copies]) for name in copies[0]}
        return {**stacked, "label": tf.fill([repeats], ex["label"])}

    ds = _epoch_stream(records, host_key, start_epoch, shuffle_buffer, repeats)
    # Whole records skipped undecoded, then the copies of the record the offset falls in.
    ds = ds.skip(offset // repeats).map(prepare, num_parallel_calls=AUTOTUNE)
    ds = ds.unbatch().skip(offset % repeats)
    ds = ds.batch(local_batch_size, drop_remainder=True).prefetch(AUTOTUNE)
    # tf.data's autotuning off: with it, tearing down the iterator when a run stopped could
    # wait for seconds before the process exited (docs/faults.md, 'Exit times'); the digits
    # pipeline reads at the same speed either way.
    options = tf.data.Options()
    options.autotune.enabled = False
    return iter(tfds.as_numpy(deterministic(ds).with_options(options)))
