"""`sklearn_digits`: scikit-learn's bundled 8x8 digits as a TFDS dataset, and
`sklearn_digits_canvas`: the same digits at random places on a 16x16 canvas.

The 1,797 images ship inside scikit-learn, so both datasets prepare offline in
well under a second. That makes them the demo, study and test datasets of this project.

Split (fixed, in scikit-learn's order, no shuffling):
  * `train`: images 0..1499 (1,500 examples);
  * `test`:  images 1500..1796 (297 examples).

Images are stored as 8x8x1 uint8 (scikit-learn's 0..16 grey levels scaled to
0..255 and rounded); upsampling to RGB is the input pipeline's job.

The canvas variant exists for the study (docs/study/): on the centred digits one fixed set
of patches can be the best occlusion for every image, so a patch-selecting adversary may
collapse to it; where the digit sits varies, no fixed mask hits every digit.

`sklearn_digits_textured`: the canvas digits (same places) on 16x16 crops of natural
photographs instead of black, so that no patch is blank and a mask that picks the empty
background is no longer one answer for every image. The photographs are the two sample
images that ship inside scikit-learn (`load_sample_images`: china.jpg and flower.jpg,
Creative Commons Attribution 2.0, by Daniel Buechele and Vladimir Rodionov on Flickr; see
sklearn/datasets/images/README.txt), in grey, shrunk 4x. The background keeps below
`TEXTURE_MAX` and every stroke pixel is at least `STROKE_MIN`, so a pixel above
`OBJECT_THRESHOLD` belongs to the digit (for the selection statistics' "on the object").
"""

import numpy as np
from sklearn.datasets import load_digits, load_sample_images
import tensorflow_datasets as tfds

NUM_TRAIN = 1500


class SklearnDigits(tfds.core.GeneratorBasedBuilder):
    """scikit-learn `load_digits()`, split 1500 train / 297 test."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(shape=(8, 8, 1), dtype=np.uint8),
                    "label": tfds.features.ClassLabel(num_classes=10),
                }
            ),
            supervised_keys=("image", "label"),
            homepage="https://scikit-learn.org/stable/modules/generated/sklearn.datasets.load_digits.html",
        )

    def _split_generators(self, dl_manager):
        """Needs no download: the data is read from the scikit-learn package."""
        del dl_manager
        images, labels = _load_uint8_digits()
        return {
            "train": self._generate_examples(images, labels, 0, NUM_TRAIN),
            "test": self._generate_examples(images, labels, NUM_TRAIN, len(images)),
        }

    def _generate_examples(self, images, labels, start, stop):
        """Keys are the indices into `load_digits()`, so examples stay traceable."""
        for i in range(start, stop):
            yield i, {"image": images[i], "label": int(labels[i])}


CANVAS_SIZE = 16
CANVAS_SEED = 0


class SklearnDigitsCanvas(SklearnDigits):
    """Each digit pasted unscaled at a random (fixed, seeded) place of a black 16x16 canvas;
    the same split as `sklearn_digits`."""

    def _info(self) -> tfds.core.DatasetInfo:
        info = super()._info()
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(
                        shape=(CANVAS_SIZE, CANVAS_SIZE, 1), dtype=np.uint8
                    ),
                    "label": tfds.features.ClassLabel(num_classes=10),
                }
            ),
            supervised_keys=info.supervised_keys,
            homepage=info.homepage,
        )

    def _split_generators(self, dl_manager):
        del dl_manager
        images, labels = _load_uint8_digits()
        images = place_on_canvas(images, np.random.default_rng(CANVAS_SEED))
        return {
            "train": self._generate_examples(images, labels, 0, NUM_TRAIN),
            "test": self._generate_examples(images, labels, NUM_TRAIN, len(images)),
        }


TEXTURE_MAX = 110  # the background's grey levels: 0..110 of 255
STROKE_MIN = 140  # a stroke pixel of level v (1..255) becomes 140 + v * 115 / 255
OBJECT_THRESHOLD = 0.5  # in [0, 1]: between the two ranges
TEXTURE_SHRINK = 4
MIN_TEXTURE_STD = 25.0  # grey levels of 255, before the scaling to 0..TEXTURE_MAX


class SklearnDigitsTextured(SklearnDigitsCanvas):
    """The canvas digits (same places) pasted on seeded 16x16 crops of scikit-learn's two
    sample photographs; the same split as `sklearn_digits`."""

    def _split_generators(self, dl_manager):
        del dl_manager
        images, labels = _load_uint8_digits()
        _, images = textured_digits(images)
        return {
            "train": self._generate_examples(images, labels, 0, NUM_TRAIN),
            "test": self._generate_examples(images, labels, NUM_TRAIN, len(images)),
        }


def textured_digits(images):
    """(the digits on the zero canvas, the same on textures): the canvas dataset's places
    (its seeded draws come first), then the seeded crops."""
    rng = np.random.default_rng(CANVAS_SEED)
    placed = place_on_canvas(images, rng)
    return placed, paste_on_textures(placed, texture_crops(len(images), rng))


def texture_crops(count: int, rng, size: int = CANVAS_SIZE):
    """(count, size, size, 1) uint8 grey crops of the sample photographs, at random places
    of a photograph drawn at random, scaled to 0..TEXTURE_MAX."""
    photos = []
    for photo in load_sample_images().images:
        grey = photo.astype(np.float32).mean(axis=-1)
        h, w = (d // TEXTURE_SHRINK * TEXTURE_SHRINK for d in grey.shape)
        shrunk = grey[:h, :w].reshape(h // TEXTURE_SHRINK, TEXTURE_SHRINK, w // TEXTURE_SHRINK, -1)
        photos.append(shrunk.mean(axis=(1, 3)))
    crops = np.empty((count, size, size), np.float32)
    for i in range(count):
        crops[i] = _textured_crop(photos, rng, size)
    return np.round(crops * (TEXTURE_MAX / 255.0)).astype(np.uint8)[..., None]


def _textured_crop(photos, rng, size: int):
    """A crop of a random photograph at a random place, drawn again while it is nearly flat
    (sky, shadow: grey-level std below MIN_TEXTURE_STD), so that every background varies."""
    while True:
        photo = photos[rng.integers(0, len(photos))]
        top = rng.integers(0, photo.shape[0] - size + 1)
        left = rng.integers(0, photo.shape[1] - size + 1)
        crop = photo[top : top + size, left : left + size]
        if crop.std() >= MIN_TEXTURE_STD:
            return crop


def paste_on_textures(placed, textures):
    """Digits on a zero canvas (uint8) over `textures`: stroke pixels (> 0) are mapped to
    STROKE_MIN..255, the rest show the texture."""
    strokes = STROKE_MIN + np.round(placed.astype(np.float32) * (255 - STROKE_MIN) / 255.0)
    return np.where(placed > 0, strokes, textures).astype(np.uint8)


def place_on_canvas(images, rng, size: int = CANVAS_SIZE):
    """(N, h, w, 1) images, each at a uniformly drawn offset of a zero (N, size, size, 1) canvas."""
    count, height, width, _ = images.shape
    canvas = np.zeros((count, size, size, 1), images.dtype)
    tops = rng.integers(0, size - height + 1, count)
    lefts = rng.integers(0, size - width + 1, count)
    for image, top, left, out in zip(images, tops, lefts, canvas):
        out[top : top + height, left : left + width] = image
    return canvas


def _load_uint8_digits():
    """Returns (N, 8, 8, 1) uint8 images scaled 0..16 -> 0..255 and (N,) labels."""
    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)
    return images[..., None], digits.target


def upsampled_train_arrays(image_size: int, mean, std):
    """The training digits as in-memory arrays: (N, image_size, image_size, 3) float32,
    nearest-upsampled (each pixel repeated), three equal channels, normalised with `mean` and
    `std`; and the (N,) int32 labels. The side-by-side comparison with the official training
    (reference/trajectory.py) and its replay test train on exactly these."""
    images, labels = _load_uint8_digits()
    images, labels = images[:NUM_TRAIN], labels[:NUM_TRAIN]
    scale = image_size // images.shape[1]
    pixels = images.repeat(scale, axis=1).repeat(scale, axis=2).repeat(3, axis=3) / 255.0
    normalised = (pixels - np.asarray(mean)) / np.asarray(std)
    return normalised.astype(np.float32), labels.astype(np.int32)
