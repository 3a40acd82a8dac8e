"""What a dataset is: its spec (classes, splits, resolution, normalisation) and, for one
that is not prepared, how to prepare it. Plain Python, no TensorFlow: the model, the
train step and the step-only tools read specs without loading TF and its host memory;
`rspc_jax.data.records` reads the datasets themselves. Nothing here downloads data at run
time."""

import dataclasses

from rspc_jax import ConfigError, ReportedError


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
    # Pixel value of an empty background ([0, 1]), where the images have one: the report then
    # compares C's masks with its mask of a blank image.
    background: float | None = None
    # Where a pixel above this value ([0, 1]) belongs to the object: the corruption model's
    # selection statistics then report how many chosen patches hold the object.
    object_threshold: float | None = None


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
        object_threshold=0.1,  # a stroke pixel of grey level 2 of 16 or more
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

# The canvas digits on crops of photographs (mean and std of its 1500 training images; the
# background stays at or below 110/255 and strokes at or above 140/255:
# rspc_jax/data/sklearn_digits.py).
_SPECS["sklearn_digits_textured"] = dataclasses.replace(
    _SPECS["sklearn_digits"],
    name="sklearn_digits_textured",
    mean=(0.2601,) * 3,
    std=(0.2418,) * 3,
    background=None,
    object_threshold=0.5,
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


def preparation_instructions(name: str, data_dir: str, manual: bool) -> str:
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
