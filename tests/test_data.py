"""Tests of the tf.data input pipeline and the offline `sklearn_digits` builder."""

import collections
import itertools
import socket

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from rspc_jax.data import eval as eval_data
from rspc_jax.data import on_device, options, records
from rspc_jax.data import specs as datasets
from rspc_jax.data import train as train_data
from tests.conftest import random_erasing_before

DIGITS = "sklearn_digits"


def eval_batches(
    *,
    dataset,
    data_dir,
    split,
    image_size,
    local_batch_size,
    eval_preprocess="",
    process_index=None,
    process_count=None,
):
    """The evaluation path's host batches of a split: (list of batches, batches per host)."""
    ds, largest = eval_data.eval_examples(
        dataset=dataset,
        data_dir=data_dir,
        split=split,
        image_size=image_size,
        eval_preprocess=eval_preprocess,
        process_index=process_index,
        process_count=process_count,
    )
    count = eval_data.num_batches(largest, local_batch_size)
    spec = datasets.dataset_spec(dataset)
    examples = ((ex["image"], ex["label"]) for ex in ds.as_numpy_iterator())
    return list(
        eval_data.host_batches(
            examples,
            local_batch=local_batch_size,
            batches=count,
            image_shape=(image_size, image_size, 3),
            mean=spec.mean,
            std=spec.std,
        )
    ), count


@pytest.fixture
def no_network(monkeypatch):
    """Fails the test if anything opens a connection."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def raw_examples(data_dir, split):
    """(uint8 images (N, 8, 8, 1), int labels) straight from tfds."""
    builder = tfds.builder(DIGITS, data_dir=data_dir)
    return tfds.as_numpy(builder.as_dataset(split=split, batch_size=-1, as_supervised=True))


def to_uint8(images, dataset=DIGITS):
    """Undoes the normalisation; valid for unaugmented 8 px digits (uint8 images, as the
    training stream yields them, are returned as they are)."""
    if np.asarray(images).dtype == np.uint8:
        return np.asarray(images)
    spec = datasets.dataset_spec(dataset)
    pixels = np.asarray(images) * np.array(spec.std) + np.array(spec.mean)
    return np.round(pixels * 255).astype(np.uint8)


def as_keys(images, labels):
    """Hashable (grey image bytes, label) per example."""
    return [(image[..., :1].tobytes(), int(label)) for image, label in zip(images, labels)]


def digits_train(data_dir, **overrides):
    kwargs = dict(
        dataset=DIGITS,
        data_dir=data_dir,
        split="train",
        image_size=16,
        local_batch_size=8,
        seed=0,
        augment="digits",
        process_index=0,
        process_count=1,
    )
    kwargs.update(overrides)
    return train_data.train_iterator(**kwargs)


def take(iterator, n):
    return list(itertools.islice(iterator, n))


def test_digits_builder_prepares_offline(tmp_path, no_network):
    from sklearn.datasets import load_digits

    builder = records.get_builder(DIGITS, str(tmp_path))
    assert builder.is_prepared()
    assert (tmp_path / DIGITS).is_dir()
    splits = builder.info.splits
    assert (splits["train"].num_examples, splits["test"].num_examples) == (1500, 297)

    images, labels = raw_examples(str(tmp_path), "test")
    assert images.shape == (297, 8, 8, 1) and images.dtype == np.uint8
    assert set(labels.tolist()) == set(range(10))
    # `test` holds exactly scikit-learn's images 1500.. (as 0..16 -> 0..255).
    digits = load_digits()
    expected = np.round(digits.images[1500:] * 255 / 16).astype(np.uint8)
    assert collections.Counter(as_keys(images, labels)) == collections.Counter(
        as_keys(expected[..., None], digits.target[1500:])
    )


def test_canvas_digits_hold_each_digit_unchanged_at_varying_places(tmp_path, no_network):
    """Offline like the digits; each canvas holds its digit's pixels exactly, in a window that
    moves from image to image; the spec's mean and std are those of the training images."""
    from rspc_jax.data import sklearn_digits

    builder = records.get_builder("sklearn_digits_canvas", str(tmp_path))
    splits = builder.info.splits
    assert (splits["train"].num_examples, splits["test"].num_examples) == (1500, 297)
    digits, _ = sklearn_digits._load_uint8_digits()
    canvas = sklearn_digits.place_on_canvas(digits, np.random.default_rng(0))
    assert canvas.shape == (1797, 16, 16, 1)
    places = []
    for digit, image in zip(digits[:200], canvas[:200], strict=True):
        found = [
            (top, left)
            for top in range(9)
            for left in range(9)
            if np.array_equal(image[top : top + 8, left : left + 8], digit)
            and image.sum() == digit.sum()  # nothing outside the window
        ]
        assert found, "a canvas does not hold its digit unchanged"
        places.append(found[0])
    assert len(set(places)) > 40  # the digit's place varies (81 possible)
    spec = datasets.dataset_spec("sklearn_digits_canvas")
    train_pixels = canvas[:1500] / 255.0
    assert spec.mean[0] == pytest.approx(train_pixels.mean(), abs=1e-4)
    assert spec.std[0] == pytest.approx(train_pixels.std(), abs=1e-4)


def test_textured_digits_keep_the_canvas_places_on_backgrounds_that_vary(tmp_path, no_network):
    """Offline; each image holds its canvas digit's strokes (brightened, in the same order of
    grey) at the canvas dataset's place, every background pixel is darker than every stroke
    pixel, no background is flat, and the spec's numbers are those of the training images."""
    from rspc_jax.data import sklearn_digits

    builder = records.get_builder("sklearn_digits_textured", str(tmp_path))
    splits = builder.info.splits
    assert (splits["train"].num_examples, splits["test"].num_examples) == (1500, 297)
    digits, _ = sklearn_digits._load_uint8_digits()
    placed, textured = sklearn_digits.textured_digits(digits)
    np.testing.assert_array_equal(
        placed, sklearn_digits.place_on_canvas(digits, np.random.default_rng(0))
    )
    built = np.stack([e["image"] for e in tfds.as_numpy(builder.as_dataset(split="train"))])
    assert sorted(i.tobytes() for i in built) == sorted(i.tobytes() for i in textured[:1500])
    strokes = placed > 0
    spec = datasets.dataset_spec("sklearn_digits_textured")
    assert np.all(textured[strokes] / 255.0 > spec.object_threshold)
    assert np.all(textured[~strokes] / 255.0 < spec.object_threshold)
    for image, digit in zip(textured[:100], placed[:100], strict=True):
        on = digit > 0
        np.testing.assert_array_equal(
            np.argsort(image[on], kind="stable"), np.argsort(digit[on], kind="stable")
        )
    background = np.where(strokes, np.nan, textured.astype(float)).reshape(len(textured), -1)
    assert np.all(np.nanstd(background, axis=1) > 3)
    assert spec.background is None  # no blank image to compare C's masks with
    assert spec.mean[0] == pytest.approx(built.mean() / 255.0, abs=1e-4)
    assert spec.std[0] == pytest.approx(built.std() / 255.0, abs=1e-4)


def prepared(batch, dataset=DIGITS) -> np.ndarray:
    """The batch's images as the train step takes them (`on_device.prepared`)."""
    spec = datasets.dataset_spec(dataset)
    return np.asarray(on_device.prepared(batch, spec.mean, spec.std))


def test_train_batches_shapes_dtypes_and_normalisation(digits_data_dir):
    batch = next(digits_train(digits_data_dir, image_size=32, augment="digits"))
    shapes = on_device.batch_shapes(8, 32, random_erase_prob=0.0)
    assert {k: (v.shape, v.dtype) for k, v in batch.items()} == shapes
    assert set(batch["label"].tolist()) <= set(range(10))
    assert batch["image"].max() > 128  # real digits, not only padding
    np.testing.assert_array_equal(batch["image"][..., 0], batch["image"][..., 2])  # grey->RGB
    # The device's normalisation has the bits of the host's float32 (x / 255 - mean) / std.
    spec = datasets.dataset_spec(DIGITS)
    host = tf.cast(batch["image"], tf.float32) / 255.0
    host = ((host - tf.constant(spec.mean)) / tf.constant(spec.std)).numpy()
    np.testing.assert_array_equal(prepared(batch), host)
    erasing = next(digits_train(digits_data_dir, image_size=32, random_erase_prob=0.25))
    shapes = on_device.batch_shapes(8, 32, random_erase_prob=0.25)
    assert {k: (v.shape, v.dtype) for k, v in erasing.items()} == shapes


def test_none_augment_is_nearest_upsampling(digits_data_dir):
    batch = next(digits_train(digits_data_dir, image_size=32, augment="none"))
    pixels = to_uint8(batch["image"])
    # Every 4x4 block of the 32 px image is one original pixel.
    blocks = pixels.reshape(8, 8, 4, 8, 4, 3)
    assert (blocks == blocks[:, :, :1, :, :1, :]).all()


TIMM_RECIPE = dict(rand_augment="rand-m9-mstd0.5-inc1", random_erase_prob=0.25)


@pytest.mark.parametrize(
    "start,options",
    [
        # 20 examples per epoch and 8 per batch: steps 2 and 5 straddle epochs.
        (3, {}),
        # x3 repeats: 60 examples per epoch of the stream, straddled by step 7.
        (6, dict(repeated_augment=3, **TIMM_RECIPE)),
    ],
)
def test_resume_is_bitwise_identical_across_epoch_boundary(digits_data_dir, start, options):
    common = dict(split="train[:20]", augment="digits", **options)
    advanced = take(digits_train(digits_data_dir, **common), start + 3)[start:]
    resumed = take(digits_train(digits_data_dir, start_step=start, **common), 3)
    for a, b in zip(advanced, resumed):
        np.testing.assert_array_equal(a["image"], b["image"])
        np.testing.assert_array_equal(a["label"], b["label"])


def test_repeated_augmentation_emits_consecutive_copies(digits_data_dir):
    # 12 records x 3 copies = 36 examples per epoch of the stream = 6 batches.
    common = dict(split="train[:12]", local_batch_size=6, repeated_augment=3)
    plain = take(digits_train(digits_data_dir, image_size=8, augment="none", **common), 12)
    images = to_uint8(np.concatenate([b["image"] for b in plain]))
    labels = np.concatenate([b["label"] for b in plain])
    records = as_keys(images, labels)
    for epoch in (records[:36], records[36:]):
        copies = [epoch[i : i + 3] for i in range(0, 36, 3)]
        assert all(c[0] == c[1] == c[2] for c in copies)
        assert sorted(c[0] for c in copies) == sorted(
            as_keys(*raw_examples(digits_data_dir, "train[:12]"))
        )
    assert records[:36:3] != records[36::3]  # each epoch is a new permutation
    # The same order with augmentation: every copy is augmented differently.
    augmented = take(digits_train(digits_data_dir, augment="digits", **TIMM_RECIPE, **common), 6)
    np.testing.assert_array_equal(np.concatenate([b["label"] for b in augmented]), labels[:36])
    images = np.concatenate([b["image"] for b in augmented])
    for i in range(0, 36, 3):
        first, second, third = images[i : i + 3]
        assert not np.array_equal(first, second)
        assert not np.array_equal(second, third)
        assert not np.array_equal(first, third)


def _train_batches_before(data_dir, *, split, start_step, repeats, local_batch_size=8, size=16):
    """The training stream as it was before repeated copies were decoded once: the oracle of
    the test below (the digits crop, the timm recipe, seed 0, one host)."""
    fold_in = tf.random.experimental.stateless_fold_in
    builder = records.get_builder(DIGITS, data_dir)
    encoded = records.encoded_records(builder, split)
    epoch_size = records.num_examples_of(encoded)
    start_epoch, offset = divmod(start_step * local_batch_size, epoch_size * repeats)
    host_key = tf.constant([0, 0], tf.int64)

    def copies(key, ex):
        keys = tf.stack([fold_in(key, r) for r in range(repeats)])
        return keys, tf.nest.map_structure(lambda t: tf.stack([t] * repeats), ex)

    def one_epoch(epoch):
        epoch_key = fold_in(host_key, epoch)
        seed = tf.random.stateless_uniform([], epoch_key, None, None, dtype=tf.int64)
        shuffled = encoded.enumerate().shuffle(10_000, seed=seed)
        keyed = shuffled.map(lambda index, ex: (fold_in(epoch_key, index), ex))
        return keyed if repeats == 1 else keyed.map(copies).unbatch()

    decode = records.image_decoder(builder)
    spec = datasets.dataset_spec(DIGITS)

    def prepare(key, ex):
        image = train_data._train_digits(decode(ex["image"]), key, size)
        image = train_data.augment_lib.rand_augment(
            image, fold_in(key, 1), TIMM_RECIPE["rand_augment"]
        )
        image = (tf.cast(image, tf.float32) / 255.0 - spec.mean) / spec.std
        image = random_erasing_before(image, fold_in(key, 2), 0.25)
        return {"image": tf.ensure_shape(image, [size, size, 3]), "label": ex["label"]}

    ds = tf.data.Dataset.counter(start_epoch).flat_map(one_epoch).skip(offset).map(prepare)
    return ds.batch(local_batch_size, drop_remainder=True).as_numpy_iterator()


@pytest.mark.parametrize("repeats,start", [(1, 0), (3, 0), (3, 4), (3, 7)])
def test_the_stream_prepared_on_the_device_is_the_host_stream_before(
    digits_data_dir, repeats, start
):
    """Decoding each record once for all its repeated-augmentation copies, normalising on
    the accelerator and drawing erasing's noise there change no pixel outside the erased
    boxes, and the boxes are the ones the host erased: from step 0 or resumed inside a
    record's copies (20 records x 3 copies = 60 per epoch: step 4 starts at copy 2 of
    record 10, step 7 crosses the epoch)."""
    common = dict(split="train[:20]", repeated_augment=repeats, **TIMM_RECIPE)
    got = take(digits_train(digits_data_dir, start_step=start, **common), 3)
    want = take(
        _train_batches_before(
            digits_data_dir, split="train[:20]", start_step=start, repeats=repeats
        ),
        3,
    )
    erased = 0
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g["label"], w["label"])
        plain = prepared({"image": g["image"]})
        images = prepared(g)
        for box, image, unerased, before in zip(g["erase_box"], images, plain, w["image"]):
            inside = np.zeros(image.shape[:2], bool)
            inside[box[0] : box[0] + box[2], box[1] : box[1] + box[3]] = True
            np.testing.assert_array_equal((before != unerased).any(-1), inside)
            np.testing.assert_array_equal(image[~inside], before[~inside])
            assert (image[inside] != unerased[inside]).all()
            erased += inside.any()
    assert 0 < erased < 24


def test_timm_augmentations_change_only_what_they_should(digits_data_dir):
    base = next(digits_train(digits_data_dir, augment="digits"))
    erased = next(digits_train(digits_data_dir, augment="digits", random_erase_prob=1.0))
    randaug = next(
        digits_train(digits_data_dir, augment="digits", rand_augment="rand-m9-mstd0.5-inc1")
    )
    np.testing.assert_array_equal(base["label"], erased["label"])
    np.testing.assert_array_equal(base["label"], randaug["label"])
    # Erasing leaves the host's pixels alone and replaces one box per image by N(0, 1)
    # values, after normalisation (on the device).
    np.testing.assert_array_equal(base["image"], erased["image"])
    for before, after in zip(prepared(base), prepared(erased)):
        changed = (before != after).any(axis=-1)
        rows, cols = np.nonzero(changed)
        box = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
        assert 0 < changed.sum() == box < 16 * 16
    # RandAugment works on uint8 pixels before normalising.
    assert not np.array_equal(base["image"], randaug["image"])
    assert randaug["image"].dtype == np.uint8


def test_each_epoch_is_a_new_permutation(digits_data_dir):
    batches = take(
        digits_train(
            digits_data_dir, split="train[:20]", image_size=8, augment="none", local_batch_size=10
        ),
        4,
    )
    images = to_uint8(np.concatenate([b["image"] for b in batches]))
    labels = np.concatenate([b["label"] for b in batches])
    first, second = as_keys(images[:20], labels[:20]), as_keys(images[20:], labels[20:])
    assert len(set(first)) == 20
    assert set(first) == set(second) and first != second


def test_seed_determines_order(digits_data_dir):
    def first_batch(seed):
        return next(digits_train(digits_data_dir, seed=seed, augment="none"))

    a, b, c = first_batch(0), first_batch(0), first_batch(1)
    np.testing.assert_array_equal(a["image"], b["image"])
    np.testing.assert_array_equal(a["label"], b["label"])
    assert not np.array_equal(a["image"], c["image"])


def test_train_shards_are_disjoint_per_host(digits_data_dir):
    def host_epoch(process_index):
        batches = take(
            digits_train(
                digits_data_dir,
                split="train[:40]",
                image_size=8,
                augment="none",
                local_batch_size=10,
                process_index=process_index,
                process_count=2,
            ),
            2,
        )
        images = to_uint8(np.concatenate([b["image"] for b in batches]))
        return set(as_keys(images, np.concatenate([b["label"] for b in batches])))

    host0, host1 = host_epoch(0), host_epoch(1)
    assert len(host0) == len(host1) == 20
    assert not host0 & host1
    assert host0 | host1 == set(as_keys(*raw_examples(digits_data_dir, "train[:40]")))


def test_eval_covers_split_exactly_once_over_two_hosts(digits_data_dir):
    seen, counts = [], []
    for process_index in (0, 1):
        batches, num_batches = eval_batches(
            dataset=DIGITS,
            data_dir=digits_data_dir,
            split="test",
            image_size=8,
            local_batch_size=64,
            process_index=process_index,
            process_count=2,
        )
        batches = list(batches)
        assert len(batches) == num_batches
        counts.append(num_batches)
        for batch in batches:
            assert batch["image"].shape == (64, 8, 8, 3)
            assert batch["mask"].dtype == np.float32
            real = batch["mask"] == 1
            assert set(np.unique(batch["mask"]).tolist()) <= {0.0, 1.0}
            assert not batch["image"][~real].any()
            seen += as_keys(to_uint8(batch["image"][real]), batch["label"][real])
    assert counts == [3, 3]  # 149 and 148 examples, 64 per batch
    assert len(seen) == 297
    assert collections.Counter(seen) == collections.Counter(
        as_keys(*raw_examples(digits_data_dir, "test"))
    )


@pytest.mark.parametrize("preprocess", ["imagenet", "crop_only"])
def test_eval_source_reads_the_same_examples_in_batches(tmp_path, preprocess):
    """loop.as_source reads READ_BATCH examples per call: the same examples, in
    the same order, bitwise, and the same host batches as reading one at a time."""
    import imageio.v3 as iio

    from rspc_jax.evaluation import loop

    rng = np.random.default_rng(0)
    count = loop.READ_BATCH + 7  # a full read batch and a partial one
    paths, labels = [], []
    for i in range(count):
        height, width = rng.integers(200, 300), rng.integers(200, 300)
        path = tmp_path / f"{i}.jpg"
        iio.imwrite(path, rng.integers(0, 256, (height, width, 3), dtype=np.uint8), quality=90)
        paths.append(str(path))
        labels.append(i % 5)
    fn = eval_data.crop_only if preprocess == "crop_only" else eval_data.imagenet
    ds, largest = eval_data.file_examples(
        paths, labels, image_size=64, preprocess=fn, process_index=0, process_count=1
    )
    one_at_a_time = [(ex["image"], ex["label"]) for ex in ds.as_numpy_iterator()]
    source, _ = loop.as_source(ds, largest)
    batched = list(source)
    assert len(batched) == len(one_at_a_time) == count
    for (image, label), (want_image, want_label) in zip(batched, one_at_a_time):
        np.testing.assert_array_equal(image, want_image)
        assert label == want_label and image.dtype == want_image.dtype == np.uint8

    def host(examples):
        return list(
            eval_data.host_batches(
                examples,
                local_batch=16,
                batches=eval_data.num_batches(largest, 16),
                image_shape=(64, 64, 3),
                mean=(0.5, 0.4, 0.3),
                std=(0.2, 0.3, 0.25),
            )
        )

    for got, want in zip(host(loop.as_source(ds, largest)[0]), host(iter(one_at_a_time))):
        for name in ("image", "label", "mask"):
            np.testing.assert_array_equal(got[name], want[name])


def _host_batches_before(
    examples, *, local_batch, batches, image_shape, mean, std, transform=None, limit=0
):
    """host_batches as it was before it normalised in place (the oracle of the test below)."""
    mean, std = np.asarray(mean, np.float32), np.asarray(std, np.float32)
    iterator, taken = iter(examples), 0
    for _ in range(batches):
        images, labels = [], []
        while len(images) < local_batch and (not limit or taken < limit):
            try:
                image, label = next(iterator)
            except StopIteration:
                break
            images.append(np.asarray(image, np.uint8))
            labels.append(int(label))
            taken += 1
        count = len(images)
        pixels = np.zeros((0,) + tuple(image_shape), np.float32)
        if count:
            raw = np.stack(images)
            if transform is not None:
                raw = transform(raw, np.asarray(labels))
            pixels = (raw.astype(np.float32) / 255.0 - mean) / std
        padding = local_batch - count
        yield {
            "image": np.concatenate(
                [pixels, np.zeros((padding,) + tuple(image_shape), np.float32)]
            ),
            "label": np.asarray(labels + [0] * padding, np.int32),
            "mask": np.asarray([1.0] * count + [0.0] * padding, np.float32),
        }


@pytest.mark.parametrize("limit", [0, 21])
@pytest.mark.parametrize("with_transform", [False, True])
def test_host_batches_bitwise_as_before(limit, with_transform):
    """In-place normalisation gives the same bits as the array-per-step arithmetic it
    replaced: every pixel value, ImageNet's mean/std, a transform, a limit, padding and
    batches past the last example."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (37, 5, 4, 3), dtype=np.uint8)
    images[:5] = np.resize(np.arange(256, dtype=np.uint8), (5, 5, 4, 3))  # every value
    labels = rng.integers(0, 1000, 37)

    def transform(batch, batch_labels):
        return (255 - batch) // 2 + (batch_labels[:, None, None, None] % 3).astype(np.uint8)

    settings = dict(
        local_batch=8,
        batches=6,
        image_shape=(5, 4, 3),
        mean=(0.485, 0.456, 0.406),
        std=(0.229, 0.224, 0.225),
        transform=transform if with_transform else None,
        limit=limit,
    )
    got = list(eval_data.host_batches(zip(images, labels), **settings))
    want = list(_host_batches_before(zip(images, labels), **settings))
    assert len(got) == len(want) == 6
    for g, w in zip(got, want):
        for name in ("image", "label", "mask"):
            assert g[name].dtype == w[name].dtype and g[name].shape == w[name].shape
            np.testing.assert_array_equal(g[name], w[name])


@pytest.mark.parametrize("with_transform", [False, True])
def test_uint8_host_batches_normalised_on_the_devices_give_the_host_bits(with_transform):
    """The evaluation loop's path: host_batches(normalise=False) yields the uint8 pixels
    (after the transform, padding zero), and `loop.normaliser` (the Context's `on_device.normalise`) on the
    devices gives exactly the bits of host_batches' own normalisation, over every value."""
    import jax.numpy as jnp

    from rspc_jax.evaluation import loop

    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (21, 5, 4, 3), dtype=np.uint8)
    images[:5] = np.resize(np.arange(256, dtype=np.uint8), (5, 5, 4, 3))
    labels = rng.integers(0, 1000, 21)

    def transform(batch, batch_labels):
        return (255 - batch) // 2 + (batch_labels[:, None, None, None] % 3).astype(np.uint8)

    spec = datasets.dataset_spec("imagenet2012")
    settings = dict(
        local_batch=8,
        batches=3,
        image_shape=(5, 4, 3),
        mean=spec.mean,
        std=spec.std,
        transform=transform if with_transform else None,
    )
    host = list(eval_data.host_batches(zip(images, labels), **settings))
    raw = list(eval_data.host_batches(zip(images, labels), normalise=False, **settings))
    normalise = loop.normaliser(spec.mean, spec.std)
    for h, r in zip(host, raw):
        assert r["image"].dtype == np.uint8
        np.testing.assert_array_equal(r["label"], h["label"])
        np.testing.assert_array_equal(r["mask"], h["mask"])
        real = h["mask"] > 0
        assert not r["image"][~real].any()  # padding stays zero
        on_devices = normalise(jnp.asarray(r["image"]))
        assert on_devices.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(on_devices)[real], h["image"][real])
    expected = transform(images[:8], labels[:8]) if with_transform else images[:8]
    np.testing.assert_array_equal(raw[0]["image"], expected)


def test_host_batches_refuses_a_transform_that_is_not_uint8():
    examples = [(np.zeros((5, 4, 3), np.uint8), 1)]
    with pytest.raises(TypeError, match="float64 images.*uint8"):
        list(
            eval_data.host_batches(
                examples,
                local_batch=2,
                batches=1,
                image_shape=(5, 4, 3),
                mean=(0.5,) * 3,
                std=(0.2,) * 3,
                transform=lambda images, labels: images / 2.0,
            )
        )


def test_host_batches_refuses_an_example_of_another_shape():
    examples = [(np.zeros((5, 4, 3), np.uint8), 1), (np.zeros((5, 4, 1), np.uint8), 2)]
    with pytest.raises(ValueError, match=r"shape \(5, 4, 1\).*image_shape"):
        list(
            eval_data.host_batches(
                examples,
                local_batch=4,
                batches=1,
                image_shape=(5, 4, 3),
                mean=(0, 0, 0),
                std=(1, 1, 1),
            )
        )


def test_eval_center_crop_is_resize_then_central_crop(digits_data_dir):
    batches, _ = eval_batches(
        dataset=DIGITS,
        data_dir=digits_data_dir,
        split="test[:4]",
        image_size=16,
        local_batch_size=4,
        eval_preprocess="center_crop",
        process_index=0,
        process_count=1,
    )
    images = next(iter(batches))["image"]
    raw, _ = raw_examples(digits_data_dir, "test[:4]")
    # 8 px -> int(16 / 0.875) = 18 px (bicubic), then the central 16 x 16.
    resized = tf.image.resize(np.repeat(raw, 3, axis=-1), [18, 18], method="bicubic")
    pixels = np.round(np.clip(resized.numpy()[:, 1:17, 1:17], 0, 255)) / 255
    spec = datasets.dataset_spec(DIGITS)
    np.testing.assert_allclose(
        images, (pixels - np.array(spec.mean)) / np.array(spec.std), atol=1e-4
    )


@pytest.mark.parametrize(
    "dataset,augment,image_size",
    [
        ("cifar10", "cifar", 32),
        ("imagenet2012", "imagenet", 24),
    ],
)
def test_mock_data_flows_through(tmp_path, dataset, augment, image_size):
    with tfds.testing.mock_data(num_examples=10):
        train = train_data.train_iterator(
            dataset=dataset,
            data_dir=str(tmp_path),
            split="train",
            image_size=image_size,
            local_batch_size=4,
            seed=0,
            augment=augment,
            process_index=0,
            process_count=1,
        )
        batch = next(train)
        batches, num_batches = eval_batches(
            dataset=dataset,
            data_dir=str(tmp_path),
            split=datasets.dataset_spec(dataset).eval_split,
            image_size=image_size,
            local_batch_size=4,
            process_index=0,
            process_count=1,
        )
        batches = list(batches)
    assert batch["image"].shape == (4, image_size, image_size, 3)
    assert batch["label"].shape == (4,) and batch["label"].dtype == np.int32
    assert np.isfinite(batch["image"]).all()
    assert num_batches == len(batches) == 3
    assert all(b["image"].shape == (4, image_size, image_size, 3) for b in batches)
    assert sum(b["mask"].sum() for b in batches) == 10


def test_missing_cifar_raises_with_build_instructions(tmp_path, no_network):
    with pytest.raises(datasets.DatasetNotFoundError) as error:
        train_data.train_iterator(
            dataset="cifar10",
            data_dir=str(tmp_path),
            split="train",
            image_size=32,
            local_batch_size=4,
            seed=0,
            augment="cifar",
            process_index=0,
            process_count=1,
        )
    message = str(error.value)
    assert isinstance(error.value, FileNotFoundError)
    assert f"tfds build cifar10 --data_dir={tmp_path}" in message
    assert "TFDS_DATA_DIR" in message
    assert not (tmp_path / "downloads").exists()


def test_missing_imagenet_raises_with_manual_instructions(tmp_path, no_network):
    with pytest.raises(datasets.DatasetNotFoundError) as error:
        records.get_builder("imagenet2012", str(tmp_path))
    message = str(error.value)
    assert f"tfds build imagenet2012 --data_dir={tmp_path}" in message
    assert "ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar" in message
    assert f"{tmp_path}/downloads/manual/" in message


def test_data_dir_defaults_to_tfds_data_dir_env(tmp_path, monkeypatch, no_network):
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path))
    with pytest.raises(datasets.DatasetNotFoundError, match=str(tmp_path)):
        records.get_builder("cifar100", None)


def test_specs():
    assert datasets.dataset_spec("imagenet2012").image_size == 224
    assert datasets.dataset_spec("imagenet2012").manual_download
    assert datasets.dataset_spec("cifar100").num_classes == 100
    assert datasets.dataset_spec("cifar10").std == (0.2470, 0.2435, 0.2616)
    assert datasets.dataset_spec(DIGITS).image_size == 32


def test_unknown_names_raise_value_error_listing_choices(digits_data_dir):
    with pytest.raises(ValueError) as error:
        datasets.dataset_spec("mnist")
    for name in ("sklearn_digits", "cifar10", "cifar100", "imagenet2012"):
        assert name in str(error.value)
    with pytest.raises(ValueError) as error:
        digits_train(digits_data_dir, augment="autoaugment")
    for name in ("digits", "cifar", "imagenet", "none"):
        assert repr(name) in str(error.value)
    with pytest.raises(ValueError, match="'center_crop'"):
        eval_batches(
            dataset=DIGITS,
            data_dir=digits_data_dir,
            split="test",
            image_size=8,
            local_batch_size=8,
            eval_preprocess="resize",
        )
    for bad, match in [
        (dict(rand_augment="rand-q3"), "rand-q3"),
        (dict(random_erase_prob=-0.1), "random_erase_prob"),
        (dict(repeated_augment=0), "repeated_augment"),
    ]:
        with pytest.raises(ValueError, match=match):
            digits_train(digits_data_dir, **bad)


def test_every_eval_preprocess_choice_that_configs_may_name_has_a_pipeline():
    """The config check (plain Python, no TF) and the TF pipelines name the same choices."""
    assert set(options.EVAL_PREPROCESS_CHOICES) == set(eval_data.EVAL_CHOICES)


def test_upsampled_train_arrays_repeat_each_pixel_and_normalise():
    """The in-memory training digits of the trajectory comparison: the first NUM_TRAIN
    images, each 8x8 pixel a 4x4 block in three equal channels, (v/255 - mean) / std."""
    from rspc_jax.data import sklearn_digits

    mean, std = (0.1, 0.2, 0.3), (0.5, 0.25, 2.0)
    images, labels = sklearn_digits.upsampled_train_arrays(32, mean, std)
    raw, raw_labels = sklearn_digits._load_uint8_digits()
    assert images.shape == (sklearn_digits.NUM_TRAIN, 32, 32, 3) and images.dtype == np.float32
    np.testing.assert_array_equal(labels, raw_labels[: sklearn_digits.NUM_TRAIN])
    pixels = images * np.asarray(std, np.float32) + np.asarray(mean, np.float32)
    block = pixels[7, 12:16, 20:24]  # pixel (3, 5) of image 7
    np.testing.assert_allclose(block, raw[7, 3, 5, 0] / 255.0, atol=1e-6)
    assert len(np.unique(raw[:50])) > 2  # not a constant image set
