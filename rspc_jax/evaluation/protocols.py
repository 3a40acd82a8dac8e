"""Metric definitions and constants of the robustness benchmarks (pure numpy, no I/O).

Everything here follows docs/evaluation.md (its sections are cited by heading); the
numbers that end up in papers depend on these details, so they are kept in one place and
tested against direct implementations of the definitions.
"""

from collections.abc import Mapping

import numpy as np

# ---------------------------------------------------------------------------------------------
# ImageNet-C (docs/evaluation.md, "ImageNet-C")

# Canonical order of hendrycks/robustness ImageNet-C/test.py (docs/evaluation.md, "ImageNet-C: corruptions and files").
IMAGENET_C_CORRUPTIONS = (
    "gaussian_noise",
    "shot_noise",
    "impulse_noise",
    "defocus_blur",
    "glass_blur",
    "motion_blur",
    "zoom_blur",
    "snow",
    "frost",
    "fog",
    "brightness",
    "contrast",
    "elastic_transform",
    "pixelate",
    "jpeg_compression",
)
# The 4 "validation" corruptions: no AlexNet normaliser, never part of mCE (docs/evaluation.md, "ImageNet-C: corruptions and files").
IMAGENET_C_EXTRA = ("speckle_noise", "gaussian_blur", "spatter", "saturate")
NOISE_CORRUPTIONS = IMAGENET_C_CORRUPTIONS[:3]
SEVERITIES = (1, 2, 3, 4, 5)

# AlexNet top-1 error, mean over the 5 severities, as a fraction (docs/evaluation.md, "ImageNet-C: AlexNet normalisers").
ALEXNET_ERR = {
    "gaussian_noise": 0.886428,
    "shot_noise": 0.894468,
    "impulse_noise": 0.922640,
    "defocus_blur": 0.819880,
    "glass_blur": 0.826268,
    "motion_blur": 0.785948,
    "zoom_blur": 0.798360,
    "snow": 0.866816,
    "frost": 0.826572,
    "fog": 0.819324,
    "brightness": 0.564592,
    "contrast": 0.853204,
    "elastic_transform": 0.646056,
    "pixelate": 0.717840,
    "jpeg_compression": 0.606500,
}


def corruption_names(setting: str) -> tuple[str, ...]:
    """config.evaluation.corruptions: 'common' (the 15), 'all' (+ the 4 extra) or a list."""
    if setting == "common":
        return IMAGENET_C_CORRUPTIONS
    if setting == "all":
        return IMAGENET_C_CORRUPTIONS + IMAGENET_C_EXTRA
    names = tuple(n.strip() for n in setting.split(",") if n.strip())
    known = IMAGENET_C_CORRUPTIONS + IMAGENET_C_EXTRA
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(
            f"unknown corruptions {unknown} in config.evaluation.corruptions; use "
            f"'common', 'all' or names from {known}"
        )
    return names


def _check_accuracy(name: object, value: float) -> None:
    """Accuracies are fractions; a percentage passed by mistake would give a silently wrong mCE."""
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"accuracy of {name} is {value}; expected a fraction in [0, 1]")


def _mean_or_none(values: list) -> float | None:
    """Mean of complete data only: one missing entry makes the aggregate None."""
    if not values or any(v is None for v in values):
        return None
    return float(np.mean(values))


def _imagenet_c_corruption_accuracies(
    accuracy: Mapping[tuple[str, int], float],
) -> dict[str, float | None]:
    """Per corruption, mean accuracy over the 5 severities; None unless all 5 are given."""
    known = IMAGENET_C_CORRUPTIONS + IMAGENET_C_EXTRA
    for (corruption, severity), value in accuracy.items():
        if corruption not in known or severity not in SEVERITIES:
            raise ValueError(
                f"unknown ImageNet-C entry {(corruption, severity)!r}; "
                f"corruptions are {known}, severities {SEVERITIES}"
            )
        _check_accuracy((corruption, severity), value)
    present = [c for c in known if any((c, s) in accuracy for s in SEVERITIES)]
    return {c: _mean_or_none([accuracy.get((c, s)) for s in SEVERITIES]) for c in present}


def corruption_error(corruption: str, mean_accuracy: float) -> float:
    """CE_c x100 = (1 - mean_s acc_{s,c}) / E^AlexNet_c * 100 (docs/evaluation.md, "ImageNet-C: mCE"; AlexNet = 100)."""
    return (1.0 - mean_accuracy) / ALEXNET_ERR[corruption] * 100.0


def imagenet_c_summary(accuracy: Mapping[tuple[str, int], float]) -> dict:
    """mCE (15), mCE w/o noise (12, the RSPC paper's column, docs/evaluation.md, "ImageNet-C: mCE without noise") and mean accuracies.

    `accuracy` maps (corruption, severity) to top-1 accuracy as a fraction. Any aggregate that
    needs an incomplete corruption is None, and `missing` lists the absent benchmark pairs.
    """
    per_corruption_accuracy = _imagenet_c_corruption_accuracies(accuracy)
    per_corruption = {}
    for corruption, acc in per_corruption_accuracy.items():
        entry = {"accuracy": acc}
        if corruption in ALEXNET_ERR:
            entry["ce"] = None if acc is None else corruption_error(corruption, acc)
        per_corruption[corruption] = entry

    def field(corruptions: tuple[str, ...], key: str) -> list:
        return [per_corruption.get(c, {}).get(key) for c in corruptions]

    non_noise = tuple(c for c in IMAGENET_C_CORRUPTIONS if c not in NOISE_CORRUPTIONS)
    return {
        "per_corruption": per_corruption,
        "mce": _mean_or_none(field(IMAGENET_C_CORRUPTIONS, "ce")),
        "mce_no_noise": _mean_or_none(field(non_noise, "ce")),
        "mean_accuracy": _mean_or_none(field(IMAGENET_C_CORRUPTIONS, "accuracy")),
        "mean_accuracy_no_noise": _mean_or_none(field(non_noise, "accuracy")),
        "mean_accuracy_19": _mean_or_none(
            field(IMAGENET_C_CORRUPTIONS + IMAGENET_C_EXTRA, "accuracy")
        ),
        "missing": [
            [c, s] for c in IMAGENET_C_CORRUPTIONS for s in SEVERITIES if (c, s) not in accuracy
        ],
    }


# ---------------------------------------------------------------------------------------------
# ImageNet-A / ImageNet-R 200-class subsets (docs/evaluation.md, "ImageNet-A and ImageNet-R", "200-class lists"): 0-based ImageNet-1k indices
# ascending, wnids in the same order (index = position in the sorted 1000 synsets).

_IMAGENET_A_INDICES = """
6 11 13 15 17 22 23 27 30 37 39 42 47 50 57 70 71 76 79 89 90 94 96 97 99 105 107 108 110 113
124 125 130 132 143 144 150 151 207 234 235 254 277 283 287 291 295 298 301 306 307 308 309 310
311 313 314 315 317 319 323 324 326 327 330 334 335 336 347 361 363 372 378 386 397 400 401 402
404 407 411 416 417 420 425 428 430 437 438 445 456 457 461 462 470 472 483 486 488 492 496 514
516 528 530 539 542 543 549 552 557 561 562 569 572 573 575 579 589 606 607 609 614 626 627 640
641 642 643 658 668 677 682 684 687 701 704 719 736 746 749 752 758 763 765 768 773 774 776 779
780 786 792 797 802 803 804 813 815 820 823 831 833 835 839 845 847 850 859 862 870 879 880 888
890 897 900 907 913 924 932 933 934 937 943 945 947 951 954 956 957 959 971 972 980 981 984 986
987 988
"""

_IMAGENET_A_WNIDS = """
n01498041 n01531178 n01534433 n01558993 n01580077 n01614925 n01616318 n01631663 n01641577 n01669191
n01677366 n01687978 n01694178 n01698640 n01735189 n01770081 n01770393 n01774750 n01784675 n01819313
n01820546 n01833805 n01843383 n01847000 n01855672 n01882714 n01910747 n01914609 n01924916 n01944390
n01985128 n01986214 n02007558 n02009912 n02037110 n02051845 n02077923 n02085620 n02099601 n02106550
n02106662 n02110958 n02119022 n02123394 n02127052 n02129165 n02133161 n02137549 n02165456 n02174001
n02177972 n02190166 n02206856 n02219486 n02226429 n02231487 n02233338 n02236044 n02259212 n02268443
n02279972 n02280649 n02281787 n02317335 n02325366 n02346627 n02356798 n02361337 n02410509 n02445715
n02454379 n02486410 n02492035 n02504458 n02655020 n02669723 n02672831 n02676566 n02690373 n02701002
n02730930 n02777292 n02782093 n02787622 n02793495 n02797295 n02802426 n02814860 n02815834 n02837789
n02879718 n02883205 n02895154 n02906734 n02948072 n02951358 n02980441 n02992211 n02999410 n03014705
n03026506 n03124043 n03125729 n03187595 n03196217 n03223299 n03250847 n03255030 n03291819 n03325584
n03355925 n03384352 n03388043 n03417042 n03443371 n03444034 n03445924 n03452741 n03483316 n03584829
n03590841 n03594945 n03617480 n03666591 n03670208 n03717622 n03720891 n03721384 n03724870 n03775071
n03788195 n03804744 n03837869 n03840681 n03854065 n03888257 n03891332 n03935335 n03982430 n04019541
n04033901 n04039381 n04067472 n04086273 n04099969 n04118538 n04131690 n04133789 n04141076 n04146614
n04147183 n04179913 n04208210 n04235860 n04252077 n04252225 n04254120 n04270147 n04275548 n04310018
n04317175 n04344873 n04347754 n04355338 n04366367 n04376876 n04389033 n04399382 n04442312 n04456115
n04482393 n04507155 n04509417 n04532670 n04540053 n04554684 n04562935 n04591713 n04606251 n07583066
n07695742 n07697313 n07697537 n07714990 n07718472 n07720875 n07734744 n07749582 n07753592 n07760859
n07768694 n07831146 n09229709 n09246464 n09472597 n09835506 n11879895 n12057211 n12144580 n12267677
"""

_IMAGENET_R_INDICES = """
1 2 4 6 8 9 11 13 22 23 26 29 31 39 47 63 71 76 79 84 90 94 96 97 99 100 105 107 113 122 125 130
132 144 145 147 148 150 151 155 160 161 162 163 171 172 178 187 195 199 203 207 208 219 231 232
234 235 242 245 247 250 251 254 259 260 263 265 267 269 276 277 281 288 289 291 292 293 296 299
301 308 309 310 311 314 315 319 323 327 330 334 335 337 338 340 341 344 347 353 355 361 362 365
366 367 368 372 388 390 393 397 401 407 413 414 425 428 430 435 437 441 447 448 457 462 463 469
470 471 472 476 483 487 515 546 555 558 570 579 583 587 593 594 596 609 613 617 621 629 637 657
658 701 717 724 763 768 774 776 779 780 787 805 812 815 820 824 833 847 852 866 875 883 889 895
907 928 931 932 933 934 936 937 943 945 947 948 949 951 953 954 957 963 965 967 980 981 983 988
"""

_IMAGENET_R_WNIDS = """
n01443537 n01484850 n01494475 n01498041 n01514859 n01518878 n01531178 n01534433 n01614925 n01616318
n01630670 n01632777 n01644373 n01677366 n01694178 n01748264 n01770393 n01774750 n01784675 n01806143
n01820546 n01833805 n01843383 n01847000 n01855672 n01860187 n01882714 n01910747 n01944390 n01983481
n01986214 n02007558 n02009912 n02051845 n02056570 n02066245 n02071294 n02077923 n02085620 n02086240
n02088094 n02088238 n02088364 n02088466 n02091032 n02091134 n02092339 n02094433 n02096585 n02097298
n02098286 n02099601 n02099712 n02102318 n02106030 n02106166 n02106550 n02106662 n02108089 n02108915
n02109525 n02110185 n02110341 n02110958 n02112018 n02112137 n02113023 n02113624 n02113799 n02114367
n02117135 n02119022 n02123045 n02128385 n02128757 n02129165 n02129604 n02130308 n02134084 n02138441
n02165456 n02190166 n02206856 n02219486 n02226429 n02233338 n02236044 n02268443 n02279972 n02317335
n02325366 n02346627 n02356798 n02363005 n02364673 n02391049 n02395406 n02398521 n02410509 n02423022
n02437616 n02445715 n02447366 n02480495 n02480855 n02481823 n02483362 n02486410 n02510455 n02526121
n02607072 n02655020 n02672831 n02701002 n02749479 n02769748 n02793495 n02797295 n02802426 n02808440
n02814860 n02823750 n02841315 n02843684 n02883205 n02906734 n02909870 n02939185 n02948072 n02950826
n02951358 n02966193 n02980441 n02992529 n03124170 n03272010 n03345487 n03372029 n03424325 n03452741
n03467068 n03481172 n03494278 n03495258 n03498962 n03594945 n03602883 n03630383 n03649909 n03676483
n03710193 n03773504 n03775071 n03888257 n03930630 n03947888 n04086273 n04118538 n04133789 n04141076
n04146614 n04147183 n04192698 n04254680 n04266014 n04275548 n04310018 n04325704 n04347754 n04389033
n04409515 n04465501 n04487394 n04522168 n04536866 n04552348 n04591713 n07614500 n07693725 n07695742
n07697313 n07697537 n07714571 n07714990 n07718472 n07720875 n07734744 n07742313 n07745940 n07749582
n07753275 n07753592 n07768694 n07873807 n07880968 n07920052 n09472597 n09835506 n10565667 n12267677
"""

IMAGENET_A_INDICES = np.array(_IMAGENET_A_INDICES.split(), dtype=np.int32)
IMAGENET_R_INDICES = np.array(_IMAGENET_R_INDICES.split(), dtype=np.int32)
IMAGENET_A_WNIDS = tuple(_IMAGENET_A_WNIDS.split())
IMAGENET_R_WNIDS = tuple(_IMAGENET_R_WNIDS.split())


def restricted_prediction(logits, indices: np.ndarray):
    """ImageNet-1k index of the best class among `indices` (docs/evaluation.md, "ImageNet-A/R: restricting the logits").

    Equivalent to Hendrycks' 200-way argmax over `logits[:, indices]` compared with the 200-way
    label, but comparable with 1k labels (TFDS, our folder readers). Works on numpy and jax arrays,
    also under jit: the index map is built in the logits' own array namespace.
    """
    position = logits[..., indices].argmax(-1)
    return logits.__array_namespace__().asarray(indices)[position]


# ---------------------------------------------------------------------------------------------
# ImageNet-P (docs/evaluation.md, "ImageNet-P")

# The 10 test perturbations (docs/evaluation.md, "ImageNet-P: perturbations and files"); names containing "noise" use the noise pairing rule.
IMAGENET_P_PERTURBATIONS = (
    "gaussian_noise",
    "shot_noise",
    "motion_blur",
    "zoom_blur",
    "snow",
    "brightness",
    "translate",
    "rotate",
    "tilt",
    "scale",
)


def _frame_pairs(num_frames: int, *, noise: bool, difficulty: int) -> tuple[np.ndarray, np.ndarray]:
    """(earlier, later) frame indices compared by ImageNet-P/test.py (docs/evaluation.md, "ImageNet-P: flip probability and top-5 distance").

    Noise: every frame against the clean frame 0 (harder noise levels are separate folders, so
    `difficulty` is ignored, as in test.py). Otherwise frames j - d and j, which is the same as
    consecutive elements of the d interleaved sub-sequences i, i + d, i + 2d, ...
    """
    if difficulty < 1:
        raise ValueError(f"difficulty must be >= 1, got {difficulty}")
    lag = 1 if noise else difficulty
    if num_frames <= lag:
        raise ValueError(f"{num_frames} frames leave no pair to compare at lag {lag}")
    later = np.arange(lag, num_frames)
    earlier = np.zeros_like(later) if noise else later - lag
    return earlier, later


def per_video_flip_rates(
    predictions: np.ndarray, *, noise: bool, difficulty: int = 1
) -> np.ndarray:
    """Per video, the fraction of compared frame pairs whose top-1 prediction differs (docs/evaluation.md, "ImageNet-P: flip probability and top-5 distance").

    `predictions`: integer class per frame, shape (videos, frames). Returned per video so that
    callers can evaluate in batches and average over all videos at the end.
    """
    predictions = np.asarray(predictions)
    earlier, later = _frame_pairs(predictions.shape[1], noise=noise, difficulty=difficulty)
    return (predictions[:, later] != predictions[:, earlier]).mean(axis=1)


def flip_probability(predictions: np.ndarray, *, noise: bool, difficulty: int = 1) -> float:
    """Flip probability FP: mean over videos of the per-video flip rate."""
    return float(per_video_flip_rates(predictions, noise=noise, difficulty=difficulty).mean())


def _ranks_of(logits: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """1-based rank of `classes` in `logits` (last axis), ties broken by class index.

    Same as scipy rankdata(-logits, method='ordinal'), without sorting all classes.
    """
    values = np.take_along_axis(logits, classes, axis=-1)[..., None]
    class_index = np.arange(logits.shape[-1])
    higher = logits[..., None, :] > values
    tied_before = (logits[..., None, :] == values) & (class_index < classes[..., None])
    return 1 + (higher | tied_before).sum(axis=-1)


def per_video_top5_distances(logits: np.ndarray, *, noise: bool, difficulty: int = 1) -> np.ndarray:
    """Per video, the mean top-5 distance over the frame pairs of the flip probability (docs/evaluation.md, "ImageNet-P: flip probability and top-5 distance").

    For a pair, sum_k |k - min(sigma_k, 6)| over k = 1..5, where sigma_k is the later frame's
    rank of the earlier frame's k-th class. `logits`: shape (videos, frames, classes).
    """
    logits = np.asarray(logits)
    earlier, later = _frame_pairs(logits.shape[1], noise=noise, difficulty=difficulty)
    top5 = np.argsort(-logits[:, earlier], axis=-1, kind="stable")[..., :5]
    sigma = _ranks_of(logits[:, later], top5)
    return np.abs(np.arange(1, 6) - np.minimum(sigma, 6)).sum(axis=-1).mean(axis=1)


def top5_distance(logits: np.ndarray, *, noise: bool, difficulty: int = 1) -> float:
    """Top-5 distance T5D: mean over videos of the per-video mean distance."""
    return float(per_video_top5_distances(logits, noise=noise, difficulty=difficulty).mean())


def normalized_rate(values: Mapping[str, float], alexnet: Mapping[str, float]) -> dict:
    """Per-perturbation ratio to AlexNet x100 (AlexNet = 100, like mCE) and the mean over the
    10 test perturbations: mFR from flip probabilities, mT5D from top-5 distances (docs/evaluation.md, "ImageNet-P: flip probability and top-5 distance").

    The AlexNet values are not published in machine-readable form; the caller supplies them.
    The mean is None unless all 10 test perturbations have both values.
    """
    ratios = {p: values[p] / alexnet[p] * 100.0 for p in values if p in alexnet}
    return {
        "per_perturbation": ratios,
        "mean": _mean_or_none([ratios.get(p) for p in IMAGENET_P_PERTURBATIONS]),
        "missing": [p for p in IMAGENET_P_PERTURBATIONS if p not in ratios],
    }


# ---------------------------------------------------------------------------------------------
# CIFAR-10-C / CIFAR-100-C (docs/evaluation.md, "CIFAR-10-C and CIFAR-100-C"): file stems of the released .npy files.

CIFAR_C_CORRUPTIONS = IMAGENET_C_CORRUPTIONS
CIFAR_C_EXTRA = IMAGENET_C_EXTRA


def cifar_c_summary(accuracy: Mapping[str, float]) -> dict:
    """Mean of the per-corruption accuracies (severities pooled, as AugMix and RSPC; docs/evaluation.md, "CIFAR-10-C and CIFAR-100-C").

    `accuracy` maps a file stem to accuracy as a fraction. Both the 15-corruption mean and the
    19-file mean are reported because papers differ; each is None unless complete.
    """
    known = CIFAR_C_CORRUPTIONS + CIFAR_C_EXTRA
    for corruption, value in accuracy.items():
        if corruption not in known:
            raise ValueError(f"unknown CIFAR-C corruption {corruption!r}; expected one of {known}")
        _check_accuracy(corruption, value)
    return {
        "per_corruption": {c: float(accuracy[c]) for c in known if c in accuracy},
        "mean_accuracy": _mean_or_none([accuracy.get(c) for c in CIFAR_C_CORRUPTIONS]),
        "mean_accuracy_19": _mean_or_none([accuracy.get(c) for c in known]),
        "missing": [c for c in CIFAR_C_CORRUPTIONS if c not in accuracy],
    }
