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
"""

import numpy as np
from sklearn.datasets import load_digits
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
