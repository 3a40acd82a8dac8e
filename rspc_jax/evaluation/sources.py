"""Host-side readers of the released benchmark file layouts.

Layouts and sources: docs/evaluation.md (its sections are cited by heading).

They return file paths or arrays plus ImageNet-1k / CIFAR labels and check the layout first, so
that a missing or partially extracted download fails with a message that says what to fetch and
where to put it, rather than with a traceback or, worse, with shifted labels.
"""

from collections.abc import Sequence
from pathlib import Path

import imageio.v3 as iio
import numpy as np

from rspc_jax import ReportedError
from rspc_jax.evaluation import protocols

IMAGE_SUFFIXES = (".jpeg", ".jpg", ".png")
VIDEO_SUFFIXES = (".mp4",)
IMAGENET_CLASSES = 1000

# Where the data come from (docs/evaluation.md: the "files" sections of each benchmark).
IMAGENET_C_ORIGIN = "ImageNet-C, Zenodo record 2235448 (hendrycks/robustness README)"
IMAGENET_P_ORIGIN = "ImageNet-P, Zenodo record 3565846 (hendrycks/robustness README)"
SUBSET_ORIGIN = (
    "ImageNet-A (hendrycks/natural-adv-examples README) or ImageNet-R "
    "(hendrycks/imagenet-r README), extracted so that each class is a wnid folder"
)
CIFAR_C_ORIGIN = "CIFAR-10-C: Zenodo record 2535967; CIFAR-100-C: Zenodo record 3555552"


class MissingDataError(ReportedError, FileNotFoundError):
    """Benchmark data absent or incomplete; the message names the path, layout and source."""

    def __init__(self, path: Path | str, problem: str, layout: str, origin: str):
        super().__init__(f"{problem}: {path}\n  expected layout: {layout}\n  data: {origin}")
        self.path = str(path)


def _class_folders(root: Path, layout: str, origin: str) -> list[Path]:
    """Sub-folders of `root` sorted by name: ImageFolder's class order."""
    if not root.is_dir():
        raise MissingDataError(root, "folder not found", layout, origin)
    folders = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.name)
    if not folders:
        raise MissingDataError(root, "no class folders in", layout, origin)
    return folders


def _require_class_count(root: Path, folders: list[Path], layout: str, origin: str) -> None:
    """Labels are positions in the sorted folder list; a missing class would shift all of them."""
    if len(folders) != IMAGENET_CLASSES:
        raise MissingDataError(
            root,
            f"found {len(folders)} class folders instead of the {IMAGENET_CLASSES} ImageNet "
            "wnids (incomplete extraction?) in",
            layout,
            origin,
        )


def _labelled_files(
    root: Path,
    folders: list[Path],
    labels: Sequence[int],
    suffixes: tuple[str, ...],
    layout: str,
    origin: str,
) -> tuple[list[str], np.ndarray]:
    """Files with `suffixes` (case-insensitive, sorted, recursive) per folder, with its label."""
    paths, file_labels, empty = [], [], []
    for folder, label in zip(folders, labels):
        files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in suffixes and p.is_file())
        if not files:
            empty.append(folder.name)
        paths.extend(str(p) for p in files)
        file_labels.extend([label] * len(files))
    if empty:
        raise MissingDataError(
            root,
            f"no {'/'.join(suffixes)} files in class folders "
            f"{empty[:5]}{' ...' if len(empty) > 5 else ''} of",
            layout,
            origin,
        )
    return paths, np.asarray(file_labels, dtype=np.int64)


def image_folder_examples(root: Path | str) -> tuple[list[str], np.ndarray]:
    """ImageFolder semantics: label = index of the class folder among the sorted sub-folders."""
    root = Path(root)
    layout, origin = "<root>/<class>/<image>.{jpeg,jpg,png}", "an ImageFolder-style directory"
    folders = _class_folders(root, layout, origin)
    return _labelled_files(root, folders, range(len(folders)), IMAGE_SUFFIXES, layout, origin)


def imagenet_c_examples(
    root: Path | str, corruption: str, severity: int
) -> tuple[list[str], np.ndarray]:
    """JPEGs and ImageNet-1k labels of one (corruption, severity) of the released ImageNet-C."""
    known = protocols.IMAGENET_C_CORRUPTIONS + protocols.IMAGENET_C_EXTRA
    if corruption not in known or severity not in protocols.SEVERITIES:
        raise ValueError(
            f"unknown ImageNet-C entry {(corruption, severity)!r}; corruptions are "
            f"{known}, severities {protocols.SEVERITIES}"
        )
    folder = Path(root) / corruption / str(severity)
    layout = "<root>/<corruption>/<severity 1-5>/<1000 wnid folders>/<image>.JPEG"
    classes = _class_folders(folder, layout, IMAGENET_C_ORIGIN)
    _require_class_count(folder, classes, layout, IMAGENET_C_ORIGIN)
    return _labelled_files(
        folder, classes, range(IMAGENET_CLASSES), IMAGE_SUFFIXES, layout, IMAGENET_C_ORIGIN
    )


def subset_folder_examples(
    root: Path | str, wnids: Sequence[str], indices: Sequence[int]
) -> tuple[list[str], np.ndarray]:
    """ImageNet-A/R images with ImageNet-1k labels: folder wnid -> its index in `indices` (docs/evaluation.md, "ImageNet-A and ImageNet-R").

    Pass protocols.IMAGENET_A_WNIDS / IMAGENET_A_INDICES (or the R lists). Every listed wnid must
    have a folder, and any other folder is an error, so a partial download cannot go unnoticed.
    """
    if len(wnids) != len(indices):
        raise ValueError(f"{len(wnids)} wnids but {len(indices)} indices")
    root = Path(root)
    layout = f"<root>/<wnid>/<image> for the {len(wnids)} class wnids"
    folders = _class_folders(root, layout, SUBSET_ORIGIN)
    index_of = {wnid: int(index) for wnid, index in zip(wnids, indices)}
    unknown = [f.name for f in folders if f.name not in index_of]
    if unknown:
        raise ValueError(f"{root}: folders {unknown} are not among the {len(wnids)} expected wnids")
    absent = sorted(set(index_of) - {f.name for f in folders})
    if absent:
        raise MissingDataError(
            root,
            f"{len(absent)} wnid folders missing (e.g. {absent[:3]}) in",
            layout,
            SUBSET_ORIGIN,
        )
    labels = [index_of[f.name] for f in folders]
    return _labelled_files(root, folders, labels, IMAGE_SUFFIXES, layout, SUBSET_ORIGIN)


def _load_npy(path: Path, layout: str) -> np.ndarray:
    if not path.is_file():
        raise MissingDataError(path, "file not found", layout, CIFAR_C_ORIGIN)
    return np.load(path, allow_pickle=False)


def cifar_c_arrays(root: Path | str, corruption: str) -> tuple[np.ndarray, np.ndarray]:
    """Images uint8 (N, 32, 32, 3) and labels int64 (N,) of one CIFAR-10/100-C file (docs/evaluation.md, "CIFAR-10-C and CIFAR-100-C").

    The release stacks 5 severity blocks of 10,000 (N = 50,000); any N divisible by 5 is read.
    """
    known = protocols.CIFAR_C_CORRUPTIONS + protocols.CIFAR_C_EXTRA
    if corruption not in known:
        raise ValueError(f"unknown CIFAR-C corruption {corruption!r}; expected one of {known}")
    root = Path(root)
    layout = "<root>/<corruption>.npy uint8 (N, 32, 32, 3) and <root>/labels.npy (N,)"
    images = _load_npy(root / f"{corruption}.npy", layout)
    labels = _load_npy(root / "labels.npy", layout)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1:] != (32, 32, 3):
        raise ValueError(
            f"{root / corruption}.npy: {images.dtype} {images.shape}, expected uint8 (N, 32, 32, 3)"
        )
    if images.shape[0] % len(protocols.SEVERITIES):
        raise ValueError(
            f"{root / corruption}.npy: {images.shape[0]} images do not split into "
            f"{len(protocols.SEVERITIES)} severity blocks"
        )
    if labels.shape != (images.shape[0],):
        raise ValueError(
            f"{root / 'labels.npy'}: shape {labels.shape}, expected "
            f"({images.shape[0]},) to match {corruption}.npy"
        )
    blocks = labels.reshape(len(protocols.SEVERITIES), -1)
    if not (blocks == blocks[0]).all():
        raise ValueError(
            f"{root / 'labels.npy'}: the severity blocks carry different labels; "
            "expected the test labels repeated once per severity"
        )
    return images, labels.astype(np.int64)


def cifar_c_severity(
    images: np.ndarray, labels: np.ndarray, severity: int
) -> tuple[np.ndarray, np.ndarray]:
    """Block of one severity (1-based): rows (s-1)*N/5 ... s*N/5 - 1 (docs/evaluation.md, "CIFAR-10-C and CIFAR-100-C")."""
    if severity not in protocols.SEVERITIES:
        raise ValueError(f"severity {severity} not in {protocols.SEVERITIES}")
    if len(images) != len(labels) or len(images) % len(protocols.SEVERITIES):
        raise ValueError(
            f"{len(images)} images and {len(labels)} labels do not form "
            f"{len(protocols.SEVERITIES)} equal severity blocks"
        )
    block = len(images) // len(protocols.SEVERITIES)
    rows = slice((severity - 1) * block, severity * block)
    return images[rows], labels[rows]


def read_video(path: Path | str) -> np.ndarray:
    """All frames of an ImageNet-P .mp4 as uint8 (T, H, W, 3) RGB, decoded by ffmpeg."""
    path = Path(path)
    if not path.is_file():
        raise MissingDataError(
            path, "video not found", "<root>/<perturbation>/<wnid>/<image>.mp4", IMAGENET_P_ORIGIN
        )
    return iio.imread(path, plugin="FFMPEG", index=...)


def imagenet_p_examples(root: Path | str, perturbation: str) -> tuple[list[str], np.ndarray]:
    """Videos and ImageNet-1k labels of one ImageNet-P perturbation folder (docs/evaluation.md, "ImageNet-P: perturbations and files").

    `perturbation` is a folder name, including the harder noise levels such as 'gaussian_noise_2'.
    """
    folder = Path(root) / perturbation
    layout = "<root>/<perturbation>/<1000 wnid folders>/<image>.mp4"
    classes = _class_folders(folder, layout, IMAGENET_P_ORIGIN)
    _require_class_count(folder, classes, layout, IMAGENET_P_ORIGIN)
    return _labelled_files(
        folder, classes, range(IMAGENET_CLASSES), VIDEO_SUFFIXES, layout, IMAGENET_P_ORIGIN
    )
