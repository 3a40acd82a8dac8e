"""tf.data input pipelines: per-host shards, deterministic and cheaply resumable.

TF only runs on the host CPU. Nothing here downloads data at run time: a
dataset that is not prepared raises `DatasetNotFoundError` with instructions,
except `sklearn_digits`, which is built offline from scikit-learn on first use.

Training streams are a pure function of (seed, host, step): epoch `e` is the
host shard reshuffled with a seed derived from (seed, host, e), and every
example is augmented with stateless random ops keyed by (seed, host, e, index
in the shard). Resuming at `start_step` therefore only skips encoded records of
the current epoch and never decodes or augments a skipped example. The DeiT/timm
augmentations (RandAugment, random erasing, repeated augmentation) live in
`rspc_jax.augment` and `_epoch_stream` and follow the same rule.
"""

import dataclasses
import functools
import os
from typing import Iterable, Iterator

import jax
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds
from absl import logging

import rspc_jax.datasets  # noqa: F401  (registers `sklearn_digits` with tfds)
from rspc_jax import augment as augment_lib

AUTOTUNE = tf.data.AUTOTUNE


def _hide_gpus_from_tf():
    """TF must not reserve accelerator memory that JAX needs."""
    try:
        tf.config.set_visible_devices([], 'GPU')
    except RuntimeError:
        logging.warning('TF was initialised before rspc_jax.input_pipeline; '
                        'it may see GPUs.')


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


# Digits: grey pixel mean/std of the 1500 training images after the builder's
# 0..255 scaling (nearest upsampling leaves them unchanged), on all 3 channels.
_SPECS = {
    'sklearn_digits': DatasetSpec(
        name='sklearn_digits', num_classes=10, train_split='train',
        eval_split='test', image_size=32, mean=(0.3052,) * 3,
        std=(0.3749,) * 3, manual_download=False),
    'cifar10': DatasetSpec(
        name='cifar10', num_classes=10, train_split='train',
        eval_split='test', image_size=32, mean=(0.4914, 0.4822, 0.4465),
        std=(0.2470, 0.2435, 0.2616), manual_download=False),
    'cifar100': DatasetSpec(
        name='cifar100', num_classes=100, train_split='train',
        eval_split='test', image_size=32, mean=(0.5071, 0.4865, 0.4409),
        std=(0.2673, 0.2564, 0.2762), manual_download=False),
    'imagenet2012': DatasetSpec(
        name='imagenet2012', num_classes=1000, train_split='train',
        eval_split='validation', image_size=224, mean=(0.485, 0.456, 0.406),
        std=(0.229, 0.224, 0.225), manual_download=True),
}

# Files that the manual-download datasets expect in <data_dir>/downloads/manual.
_MANUAL_FILES = {
    'imagenet2012': 'ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar',
}


def dataset_spec(name: str) -> DatasetSpec:
    """Returns the spec of a supported dataset; ValueError names the others."""
    if name not in _SPECS:
        raise ValueError(
            f'Unknown dataset {name!r}; known datasets: {sorted(_SPECS)}.')
    return _SPECS[name]


class DatasetNotFoundError(FileNotFoundError):
    """A dataset is not prepared in the data_dir; the message says how to fix it."""


def _preparation_instructions(name: str, data_dir: str, manual: bool) -> str:
    """How to prepare `name` offline, since this project never downloads."""
    build = f'`tfds build {name} --data_dir={data_dir}`'
    if manual:
        files = _MANUAL_FILES.get(name, "the files in the builder's manual "
                                        'download instructions')
        how = (f'put {files} in {data_dir}/downloads/manual/ and run {build}')
    else:
        how = (f'on a machine with internet run {build} (or copy an existing '
               f'tensorflow_datasets/{name} directory into {data_dir})')
    return (f'Dataset {name!r} is not prepared in data_dir {data_dir!r}, and '
            f'rspc_jax never downloads data at run time. To prepare it, {how}. '
            f'Then point runs at it with TFDS_DATA_DIR={data_dir} or '
            f'--config.data_dir={data_dir}.')


def _resolve_data_dir(data_dir: str | None) -> str:
    return (data_dir or os.environ.get('TFDS_DATA_DIR')
            or tfds.core.constants.DATA_DIR)


def _tfds_is_mocked() -> bool:
    """Under `tfds.testing.mock_data` nothing is on disk by design."""
    prepare = tfds.core.DatasetBuilder.download_and_prepare
    return prepare.__module__.startswith('tensorflow_datasets.testing')


def get_builder(name: str, data_dir: str | None) -> tfds.core.DatasetBuilder:
    """Returns the prepared builder of `name`; never downloads.

    `sklearn_digits` is prepared on first use (it needs no network); any other
    dataset that is missing raises `DatasetNotFoundError`.
    """
    data_dir = _resolve_data_dir(data_dir)
    builder = tfds.builder(name, data_dir=data_dir)
    if builder.is_prepared() or _tfds_is_mocked():
        return builder
    if name == 'sklearn_digits':
        builder.download_and_prepare()
        return builder
    manual = bool(builder.MANUAL_DOWNLOAD_INSTRUCTIONS)
    raise DatasetNotFoundError(
        _preparation_instructions(name, data_dir, manual))


# ----------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------


def _process(process_index: int | None,
             process_count: int | None) -> tuple[int, int]:
    if process_index is None:
        process_index = jax.process_index()
    if process_count is None:
        process_count = jax.process_count()
    return process_index, process_count


def _encoded_records(builder, split) -> tf.data.Dataset:
    """{'image': encoded bytes, 'label': int32} in on-disk order.

    Images stay encoded so that skipping and shuffling records is cheap; they
    are decoded by `_image_decoder` after the skip.
    """
    ds = builder.as_dataset(
        split=split, shuffle_files=False,
        decoders={'image': tfds.decode.SkipDecoding()},
        read_config=tfds.ReadConfig(try_autocache=False, skip_prefetch=True))
    return ds.map(lambda ex: {'image': ex['image'],
                              'label': tf.cast(ex['label'], tf.int32)})


def _image_decoder(builder):
    """Returns fn(encoded) -> uint8 RGB image (grey images repeated x3)."""
    feature = builder.info.features['image']

    def decode(encoded):
        image = feature.decode_example(encoded)
        if image.shape[-1] == 1:
            image = tf.image.grayscale_to_rgb(image)
        return image

    return decode


def _num_examples(ds: tf.data.Dataset) -> int:
    """tfds datasets know their size; under mock_data it is the mocked count."""
    return int(ds.cardinality())


def num_examples(*, dataset: str, data_dir: str | None, split: str) -> int:
    """Examples in `split` of `dataset` (all hosts together)."""
    return _num_examples(_encoded_records(get_builder(dataset, data_dir), split))


def _deterministic(ds: tf.data.Dataset) -> tf.data.Dataset:
    options = tf.data.Options()
    options.deterministic = True
    return ds.with_options(options)


# ----------------------------------------------------------------------------
# Preprocessing: fn(uint8 RGB image, [key,] size) -> float32 in [0, 255]
# ----------------------------------------------------------------------------


def _eval_digits(image, size):
    """Nearest upsampling keeps the digits' pixels sharp and their statistics."""
    return tf.image.resize(image, [size, size], method='nearest')


def _eval_cifar(image, size):
    """Identity at 32 px; bilinear (antialiased) resize otherwise."""
    return tf.image.resize(image, [size, size], method='bilinear',
                           antialias=True)


def _eval_imagenet(image, size):
    """Shorter side to size/0.875 (bicubic), then the central size x size crop."""
    shorter = int(size / 0.875)
    hw = tf.cast(tf.shape(image)[:2], tf.float32)
    new_hw = tf.cast(tf.round(hw * shorter / tf.reduce_min(hw)), tf.int32)
    image = tf.image.resize(image, tf.maximum(new_hw, size), method='bicubic')
    offset = (tf.shape(image)[:2] - size) // 2
    image = tf.slice(image, [offset[0], offset[1], 0], [size, size, 3])
    return tf.clip_by_value(image, 0.0, 255.0)


_EVAL_PREPROCESS = {
    'sklearn_digits': _eval_digits,
    'cifar10': _eval_cifar,
    'cifar100': _eval_cifar,
    'imagenet2012': _eval_imagenet,
}

# eval_preprocess choices besides '' (the dataset's default): 'center_crop' is
# the official evaluation at 224 px on every dataset, Resize(256) + CenterCrop.
_EVAL_CHOICES = {
    'center_crop': _eval_imagenet,
}


def _random_translate(image, key, size, pad):
    """Shift by up to +-pad pixels in each direction, filling with zeros."""
    padded = tf.pad(image, [[pad, pad], [pad, pad], [0, 0]])
    return tf.image.stateless_random_crop(padded, [size, size, 3], seed=key)


def _train_digits(image, key, size):
    """Upsample, then shift by up to +-1 original pixel (size/8 px)."""
    image = _eval_digits(image, size)
    return _random_translate(image, key, size, pad=round(size / 8))


def _train_cifar(image, key, size):
    """Random crop with 4 px zero padding (at 32 px) and horizontal flip."""
    crop_key, flip_key = tf.unstack(tf.random.experimental.stateless_split(key))
    image = _eval_cifar(image, size)
    image = _random_translate(image, crop_key, size, pad=round(4 * size / 32))
    return tf.image.stateless_random_flip_left_right(image, flip_key)


def _train_imagenet(image, key, size, area=(0.08, 1.0), aspect=(3 / 4, 4 / 3)):
    """Inception crop (area 8-100%, aspect 3/4-4/3 by default), bicubic resize, flip."""
    crop_key, flip_key = tf.unstack(tf.random.experimental.stateless_split(key))
    begin, crop_size, _ = tf.image.stateless_sample_distorted_bounding_box(
        tf.shape(image), bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]),
        seed=crop_key, min_object_covered=0.0, aspect_ratio_range=tuple(aspect),
        area_range=tuple(area), max_attempts=10,
        use_image_if_no_bounding_boxes=True)
    image = tf.slice(image, begin, crop_size)
    image = tf.image.resize(image, [size, size], method='bicubic')
    image = tf.clip_by_value(image, 0.0, 255.0)
    return tf.image.stateless_random_flip_left_right(image, flip_key)


_AUGMENTS = {
    'digits': _train_digits,
    'cifar': _train_cifar,
    'imagenet': _train_imagenet,
}


def _train_preprocess(augment: str, dataset: str, crop_area=None, crop_aspect=None):
    """Returns fn(image, key, size); 'none' is the dataset's eval preprocessing.
    `crop_area` / `crop_aspect` replace the 'imagenet' crop's ranges."""
    if augment == 'none':
        eval_fn = _EVAL_PREPROCESS[dataset]
        return lambda image, key, size: eval_fn(image, size)
    if augment not in _AUGMENTS:
        raise ValueError(f'Unknown augment {augment!r}; choose one of '
                         f'{sorted([*_AUGMENTS, "none"])}.')
    if augment == 'imagenet' and (crop_area or crop_aspect):
        return functools.partial(_train_imagenet, area=crop_area or (0.08, 1.0),
                                 aspect=crop_aspect or (3 / 4, 4 / 3))
    return _AUGMENTS[augment]


def check_augmentation(*, rand_augment: str = '', random_erase_prob: float = 0.0,
                       repeated_augment: int = 1,
                       eval_preprocess: str = '') -> None:
    """Raises ValueError naming the bad option, before any pipeline is built."""
    if rand_augment:
        augment_lib.parse_rand_augment(rand_augment)
    if not 0.0 <= random_erase_prob <= 1.0:
        raise ValueError(f'random_erase_prob={random_erase_prob!r} is a '
                         'probability and must be in [0, 1].')
    if int(repeated_augment) != repeated_augment or repeated_augment < 1:
        raise ValueError(f'repeated_augment={repeated_augment!r} must be an '
                         'integer >= 1 (1 = off, DeiT uses 3).')
    if eval_preprocess and eval_preprocess not in _EVAL_CHOICES:
        raise ValueError(f'Unknown eval_preprocess {eval_preprocess!r}; choose '
                         f'one of {["", *sorted(_EVAL_CHOICES)]} ("" = the '
                         "dataset's default).")


def _normalise(image, spec: DatasetSpec, size: int):
    """(x/255 - mean) / std, with the static shape that batching needs."""
    image = tf.cast(image, tf.float32) / 255.0
    image = (image - tf.constant(spec.mean)) / tf.constant(spec.std)
    return tf.ensure_shape(image, [size, size, 3])


# ----------------------------------------------------------------------------
# Iterators
# ----------------------------------------------------------------------------


def _epoch_stream(records, host_key, start_epoch, shuffle_buffer, repeats=1):
    """Infinite stream of (example key, record), starting at `start_epoch`.

    Each epoch is reshuffled with a seed derived from (host_key, epoch) and each
    record is keyed by (host_key, epoch, index in the shard), so the stream does
    not depend on where it was started.

    `repeats` > 1 is DeiT's repeated augmentation (RASampler): every record is
    emitted `repeats` times in a row, copy r keyed by fold_in(record key, r) so
    that the copies are augmented differently, and an epoch of the stream has
    `repeats` x the shard's records. Consecutive copies land in the same batch
    (except where they straddle a batch boundary), as RASampler sends them to
    neighbouring GPUs of the same step. RASampler takes the first 1/repeats of
    a fresh permutation every training epoch; here one permutation is consumed
    over `repeats` training epochs instead, so each of those still holds about
    N / repeats records x repeats copies, but no record is skipped however small
    the shuffle buffer (taking the first third of a buffered shuffle would
    mostly see the first third of the on-disk order).
    """
    fold_in = tf.random.experimental.stateless_fold_in

    def copies(key, ex):
        keys = tf.stack([fold_in(key, r) for r in range(repeats)])
        return keys, tf.nest.map_structure(lambda t: tf.stack([t] * repeats),
                                           ex)

    def one_epoch(epoch):
        epoch_key = fold_in(host_key, epoch)
        shuffle_seed = tf.random.stateless_uniform(
            [], seed=epoch_key, minval=None, maxval=None, dtype=tf.int64)
        shuffled = records.enumerate().shuffle(shuffle_buffer, seed=shuffle_seed)
        keyed = shuffled.map(lambda index, ex: (fold_in(epoch_key, index), ex))
        return keyed if repeats == 1 else keyed.map(copies).unbatch()

    return tf.data.Dataset.counter(start_epoch).flat_map(one_epoch)


def train_iterator(*, dataset: str, data_dir: str | None, split: str,
                   image_size: int, local_batch_size: int, seed: int,
                   start_step: int = 0, augment: str,
                   shuffle_buffer: int = 10_000,
                   rand_augment: str = '', random_erase_prob: float = 0.0,
                   repeated_augment: int = 1, color_jitter: float = 0.0,
                   crop_area=None, crop_aspect=None,
                   process_index: int | None = None,
                   process_count: int | None = None) -> Iterator[dict]:
    """Yields this host's training batches forever, starting at `start_step`.

    Batches: {'image': float32 (local_batch_size, image_size, image_size, 3)
    normalised with the dataset's mean/std, 'label': int32 (local_batch_size,)}.
    The batch at step s is bitwise the same whether the iterator started at 0
    and was advanced s times or started at `start_step=s`. Each host reads its
    own equal-sized shard of `split` (the remainder is dropped).

    The order is timm's create_transform: `augment` (crop, flip; `crop_area`,
    `crop_aspect` ranges of the 'imagenet' crop), then colour jitter
    `color_jitter` (0 = off) or RandAugment `rand_augment` ('' = off, e.g.
    'rand-m9-mstd0.5-inc1') on the crop, normalisation, then random erasing
    with `random_erase_prob`.
    `repeated_augment` > 1 emits every record that many times in a row, with
    different augmentations (`_epoch_stream`).
    """
    check_augmentation(rand_augment=rand_augment,
                       random_erase_prob=random_erase_prob,
                       repeated_augment=repeated_augment)
    spec = dataset_spec(dataset)
    preprocess = _train_preprocess(augment, dataset, crop_area, crop_aspect)
    builder = get_builder(dataset, data_dir)
    process_index, process_count = _process(process_index, process_count)
    host_split = tfds.split_for_jax_process(
        split, process_index=process_index, process_count=process_count,
        drop_remainder=True)
    records = _encoded_records(builder, host_split)
    epoch_size = _num_examples(records)
    if epoch_size <= 0:
        raise ValueError(f'Host {process_index} of {process_count} has no '
                         f'examples of {dataset} split {split!r}.')
    repeats = int(repeated_augment)
    start_epoch, offset = divmod(start_step * local_batch_size,
                                 epoch_size * repeats)
    host_key = tf.constant([seed, process_index], tf.int64)
    decode = _image_decoder(builder)
    fold_in = tf.random.experimental.stateless_fold_in

    def prepare(key, ex):
        image = preprocess(decode(ex['image']), key, image_size)
        if color_jitter > 0:
            image = augment_lib.color_jitter(image, fold_in(key, 3), color_jitter)
        if rand_augment:
            image = augment_lib.rand_augment(image, fold_in(key, 1),
                                             rand_augment)
        image = _normalise(image, spec, image_size)
        if random_erase_prob > 0:
            image = augment_lib.random_erasing(image, fold_in(key, 2),
                                               random_erase_prob)
        return {'image': image, 'label': ex['label']}

    ds = _epoch_stream(records, host_key, start_epoch, shuffle_buffer, repeats)
    ds = ds.skip(offset).map(prepare, num_parallel_calls=AUTOTUNE)
    ds = ds.batch(local_batch_size, drop_remainder=True).prefetch(AUTOTUNE)
    return iter(tfds.as_numpy(_deterministic(ds)))


def _padding(image_size: int) -> tf.data.Dataset:
    """Endless all-zero examples with mask 0 that fill up eval batches."""
    return tf.data.Dataset.from_tensors({
        'image': tf.zeros([image_size, image_size, 3], tf.float32),
        'label': tf.constant(0, tf.int32),
        'mask': tf.constant(0.0, tf.float32),
    }).repeat()


def _host_records(builder, split, process_index, process_count):
    """(this host's encoded records of `split`, the largest host's count): every
    example on exactly one host."""
    process_index, process_count = _process(process_index, process_count)
    host_splits = tfds.even_splits(split, n=process_count)
    largest = max(_num_examples(_encoded_records(builder, host_split))
                  for host_split in host_splits)
    return _encoded_records(builder, host_splits[process_index]), largest


def eval_preprocess_fn(dataset: str, eval_preprocess: str = ''):
    """The eval preprocessing of `dataset`, or the named `eval_preprocess` choice."""
    check_augmentation(eval_preprocess=eval_preprocess)
    return (_EVAL_CHOICES[eval_preprocess] if eval_preprocess
            else _EVAL_PREPROCESS[dataset])


def crop_only(image, size):
    """The ImageNet-C/-P protocol (RVT, RSPC, Hendrycks): the released images are
    already 224 x 224 crops, so only CenterCrop(size) (the identity at 224); images
    smaller than `size` are first resized up (bicubic)."""
    hw = tf.shape(image)[:2]
    scale = tf.maximum(1.0, size / tf.cast(tf.reduce_min(hw), tf.float32))
    image = tf.cast(image, tf.float32)
    if_smaller = tf.cast(tf.math.ceil(tf.cast(hw, tf.float32) * scale), tf.int32)
    image = tf.cond(scale > 1.0,
                    lambda: tf.image.resize(image, if_smaller, method='bicubic'),
                    lambda: image)
    offset = (tf.shape(image)[:2] - size) // 2
    return tf.slice(image, [offset[0], offset[1], 0], [size, size, 3])


def _as_uint8(image, size):
    """Rounded to uint8, as saving the preprocessed image would do (ImageNet-C's JPEGs):
    the robustness suites corrupt pixels before normalising."""
    image = tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8)
    return tf.ensure_shape(image, [size, size, 3])


def eval_examples(*, dataset: str, data_dir: str | None, split: str,
                  image_size: int, eval_preprocess: str = '',
                  builder_name: str | None = None, preprocess=None,
                  process_index: int | None = None,
                  process_count: int | None = None) -> tuple[tf.data.Dataset, int]:
    """This host's share of `split` as unbatched {'image': uint8 (size, size, 3),
    'label'} after the eval preprocessing, and the largest host's example count.

    `builder_name` reads another tfds dataset (e.g. `imagenet_r`) with the
    preprocessing of `dataset` (or `preprocess`, fn(image, size)).
    """
    preprocess = preprocess or eval_preprocess_fn(dataset, eval_preprocess)
    builder = get_builder(builder_name or dataset, data_dir)
    records, largest = _host_records(builder, split, process_index, process_count)
    decode = _image_decoder(builder)

    def prepare(ex):
        return {'image': _as_uint8(preprocess(decode(ex['image']), image_size), image_size),
                'label': ex['label']}

    return _deterministic(records.map(prepare, num_parallel_calls=AUTOTUNE)), largest


def host_share(count: int, process_index: int | None = None,
               process_count: int | None = None) -> tuple[slice, int]:
    """This host's contiguous rows of `count` (as tfds.even_splits), the largest share."""
    process_index, process_count = _process(process_index, process_count)
    bounds = np.linspace(0, count, process_count + 1).round().astype(int)
    return (slice(bounds[process_index], bounds[process_index + 1]),
            int(np.diff(bounds).max()))


def file_examples(paths, labels, *, image_size: int, preprocess,
                  process_index: int | None = None,
                  process_count: int | None = None) -> tuple[tf.data.Dataset, int]:
    """Image files (JPEG/PNG, e.g. ImageNet-C/A/R folders) as eval_examples does."""
    rows, largest = host_share(len(paths), process_index, process_count)

    def load(path, label):
        image = tf.io.decode_image(tf.io.read_file(path), channels=3, expand_animations=False)
        return {'image': _as_uint8(preprocess(image, image_size), image_size),
                'label': tf.cast(label, tf.int32)}

    ds = tf.data.Dataset.from_tensor_slices((np.asarray(paths)[rows], np.asarray(labels)[rows]))
    return _deterministic(ds.map(load, num_parallel_calls=AUTOTUNE)), largest


def array_examples(images: np.ndarray, labels: np.ndarray, *, image_size: int, preprocess,
                   process_index: int | None = None,
                   process_count: int | None = None) -> tuple[tf.data.Dataset, int]:
    """uint8 image arrays (CIFAR-C's .npy files) as eval_examples does."""
    rows, largest = host_share(len(images), process_index, process_count)

    def prepare(image, label):
        return {'image': _as_uint8(preprocess(image, image_size), image_size),
                'label': tf.cast(label, tf.int32)}

    ds = tf.data.Dataset.from_tensor_slices((images[rows], labels[rows]))
    return _deterministic(ds.map(prepare, num_parallel_calls=AUTOTUNE)), largest


def eval_iterator(*, dataset: str, data_dir: str | None, split: str,
                  image_size: int, local_batch_size: int,
                  eval_preprocess: str = '',
                  process_index: int | None = None,
                  process_count: int | None = None
                  ) -> tuple[Iterable[dict], int]:
    """Returns (re-iterable of this host's eval batches, num_batches).

    Every example of `split` is on exactly one host; batches carry 'mask'
    (float32, 1 = real example, 0 = padding). All hosts yield the same
    num_batches, padding with fully-masked batches where they have fewer
    examples, so collective ops in the eval step stay in lockstep.
    `eval_preprocess`: '' = the dataset's default, 'center_crop' = shorter
    side to image_size / 0.875 (bicubic) and the central crop.
    """
    spec = dataset_spec(dataset)
    preprocess = eval_preprocess_fn(dataset, eval_preprocess)
    builder = get_builder(dataset, data_dir)
    records, largest = _host_records(builder, split, process_index, process_count)
    num_batches = -(-largest // local_batch_size)
    decode = _image_decoder(builder)

    def prepare(ex):
        image = preprocess(decode(ex['image']), image_size)
        return {'image': _normalise(image, spec, image_size),
                'label': ex['label'], 'mask': tf.constant(1.0, tf.float32)}

    ds = records.map(prepare, num_parallel_calls=AUTOTUNE)
    ds = ds.concatenate(_padding(image_size))
    ds = ds.take(num_batches * local_batch_size).batch(local_batch_size)
    return tfds.as_numpy(_deterministic(ds.prefetch(AUTOTUNE))), num_batches
