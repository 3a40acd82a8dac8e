"""The data options a config names (RandAugment strings, random erasing, repeated
augmentation, eval preprocessing), parsed and checked in plain Python: the trainer checks a
config before it builds any pipeline, and the step-only tools (benchmark, memory planner)
never load TensorFlow. The TF ops that apply them live in `augment`, `eval` and `train`."""

import dataclasses
import math
import re

# The ops of timm's RandAugment, in timm's order (`augment` implements each by name).
_OPS_INCREASING = (
    "AutoContrast",
    "Equalize",
    "Invert",
    "Rotate",
    "PosterizeIncreasing",
    "SolarizeIncreasing",
    "SolarizeAdd",
    "ColorIncreasing",
    "ContrastIncreasing",
    "BrightnessIncreasing",
    "SharpnessIncreasing",
    "ShearX",
    "ShearY",
    "TranslateXRel",
    "TranslateYRel",
)
_OPS_DEFAULT = (
    "AutoContrast",
    "Equalize",
    "Invert",
    "Rotate",
    "Posterize",
    "Solarize",
    "SolarizeAdd",
    "Color",
    "Contrast",
    "Brightness",
    "Sharpness",
    "ShearX",
    "ShearY",
    "TranslateXRel",
    "TranslateYRel",
)

# eval_preprocess choices besides '' (the dataset's default): 'center_crop' is the
# official evaluation at 224 px on every dataset, Resize(256) + CenterCrop.
EVAL_PREPROCESS_CHOICES = ("center_crop",)


@dataclasses.dataclass(frozen=True)
class RandAugmentSpec:
    """A parsed timm RandAugment string; defaults are timm's for 'rand'."""

    magnitude: int = 10
    num_layers: int = 2
    magnitude_std: float = 0.0  # inf: uniform in [0, magnitude]
    magnitude_max: int = 10
    increasing: bool = False
    prob: float = 0.5  # of applying each chosen op

    @property
    def ops(self) -> tuple:
        return _OPS_INCREASING if self.increasing else _OPS_DEFAULT


def _parse_mstd(value: str) -> float:
    std = float(value)
    return math.inf if std > 100 else std  # timm: above 100 means uniform


_SECTIONS = {  # spec section -> (field, parser)
    "m": ("magnitude", int),
    "n": ("num_layers", int),
    "mstd": ("magnitude_std", _parse_mstd),
    "mmax": ("magnitude_max", lambda value: int(value) or 10),
    "inc": ("increasing", lambda value: bool(int(value))),
    "p": ("prob", float),
}


def parse_rand_augment(spec: str) -> RandAugmentSpec:
    """Parses a timm RandAugment string such as 'rand-m9-mstd0.5-inc1'.

    Sections after 'rand' (any order): m<int> magnitude, n<int> ops per image,
    mstd<float> magnitude noise std (> 100: uniform), mmax<int> magnitude cap,
    inc<0|1> the 'increasing' op set, p<float> probability of each op.
    timm's weighted op choice (w<int>) is not supported.
    """
    parts = spec.split("-")
    if parts[0] != "rand":
        raise ValueError(
            f'RandAugment spec {spec!r} must start with "rand", e.g. "rand-m9-mstd0.5-inc1".'
        )
    fields = {}
    for part in parts[1:]:
        match = re.fullmatch(r"([a-z]+)(\d.*)", part)
        if not match or match[1] not in _SECTIONS:
            raise ValueError(
                f"Unknown section {part!r} in RandAugment spec {spec!r}; "
                f"sections are <key><number> with key in {sorted(_SECTIONS)}."
            )
        field, parse = _SECTIONS[match[1]]
        try:
            fields[field] = parse(match[2])
        except ValueError:
            raise ValueError(
                f"Bad number in section {part!r} of RandAugment spec {spec!r}."
            ) from None
    parsed = RandAugmentSpec(**fields)
    if parsed.num_layers < 1 or parsed.magnitude < 0 or parsed.magnitude_std < 0:
        raise ValueError(f"RandAugment spec {spec!r} needs n >= 1, m >= 0 and mstd >= 0.")
    if not 0.0 <= parsed.prob <= 1.0:
        raise ValueError(f"RandAugment spec {spec!r}: p must be in [0, 1].")
    return parsed


def check_eval_preprocess(eval_preprocess: str) -> None:
    """Raises ValueError naming the choices for an unknown `eval_preprocess`."""
    if eval_preprocess and eval_preprocess not in EVAL_PREPROCESS_CHOICES:
        raise ValueError(
            f"Unknown eval_preprocess {eval_preprocess!r}; choose "
            f'one of {["", *EVAL_PREPROCESS_CHOICES]} ("" = the '
            "dataset's default)."
        )


def check_augmentation(
    *,
    rand_augment: str = "",
    random_erase_prob: float = 0.0,
    repeated_augment: int = 1,
    eval_preprocess: str = "",
) -> None:
    """Raises ValueError naming the bad option, before any pipeline is built."""
    if rand_augment:
        parse_rand_augment(rand_augment)
    if not 0.0 <= random_erase_prob <= 1.0:
        raise ValueError(
            f"random_erase_prob={random_erase_prob!r} is a probability and must be in [0, 1]."
        )
    if int(repeated_augment) != repeated_augment or repeated_augment < 1:
        raise ValueError(
            f"repeated_augment={repeated_augment!r} must be an integer >= 1 (1 = off, DeiT uses 3)."
        )
    check_eval_preprocess(eval_preprocess)
