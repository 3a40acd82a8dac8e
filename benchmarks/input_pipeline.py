"""Images per second per host core of our tf.data input pipelines, side by side with the
official loaders (timm's transforms on PIL images in a PyTorch DataLoader), on the same
local files.

    python -m benchmarks.input_pipeline --images=2000 --classes=10 --cores=1,2 --batch=64

It makes, in --data_dir (default: a temporary folder; a given one is reused for the same
sizes and must otherwise be new or empty), a small ImageNet of real-sized JPEGs
(crops and rescales of the photographs that scikit-image ships, else scikit-learn's two
sample images; 500 x 375 to 640 x 480, quality 90) in three layouts:

- the tfds `imagenet2012` manual-download tars (`ILSVRC2012_img_train.tar` of per-class
  tars, `ILSVRC2012_img_val.tar`, labelled by tfds's validation label list), built with tfds
  as README's recipe does, for our training and evaluation readers;
- the same files as ImageFolders (`folders/train/<wnid>/`, `folders/val/<wnid>/`) for the
  official loaders;
- an ImageNet-C tree (`imagenet_c/<corruption>/<severity>/<1000 wnids>/*.JPEG`, 224 x 224
  JPEGs as released), for our `imagenet_c_dir` reader and the official loop's ImageFolder.

Then, one measurement at a time, each in its own process pinned to 1, 2, ... cores
(`os.sched_setaffinity`; TF's thread pools and PyTorch's workers and threads set to match):

- train: ours is `data.train.train_iterator` with the DeiT/RVT recipe of the project's
  configs (`recipes.apply_imagenet_recipe`: inception crop, flip, rand-m9-mstd0.5-inc1,
  random erasing 0.25, repeated augmentation x3, normalisation, batching; mixup runs on the
  device and is not counted); official is DeiT's `create_transform(is_training=True, ...)`
  on an ImageFolder in a DataLoader with as many workers as cores;
- eval: resize 256 + centre crop 224 of the validation split: ours is the evaluation
  loop's path (`eval_examples` -> `as_source` -> `host_batches`, uint8 batches that the
  accelerator normalises, not counted, as mixup), official DeiT's eval transform (with its
  normalisation) in a DataLoader;
- imagenet_c: one (corruption, severity) folder: ours `sources.imagenet_c_examples` ->
  `file_examples(crop_only)` -> `host_batches`, official RVT's loop (ImageFolder with
  CenterCrop(224) in a DataLoader).

"first pass" is the images of one pass over the files (an epoch for training) over the
seconds from building the pipeline to its end; "steady" the median images/s of --windows
windows of --seconds each that follow. The last table gives the host cores that would feed
the accelerator step rates of docs/speed.md's H200 table (`H200_STEPS`) at the measured
per-core training rate.

timm 1.0.31's PosterizeIncreasing calls `ImageOps.posterize(img, 0)` at magnitude 10, which
Pillow >= 13 refuses; requirements-torch.txt pins Pillow 12.3.0, which returns a black image
as timm expects. Where the installed Pillow refuses, the official side here patches timm's
posterize to that black image (`patch_timm_posterize`) and the table says so.
"""

import io
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

from absl import app, flags
import numpy as np

_IMAGES = flags.DEFINE_integer("images", 2000, "Training images.")
_CLASSES = flags.DEFINE_integer("classes", 10, "Training classes.")
_VAL_IMAGES = flags.DEFINE_integer("val_images", 1000, "Validation images.")
_C_IMAGES = flags.DEFINE_integer(
    "c_images", 1000, "ImageNet-C images of the one (corruption, severity), >= 1000 (one per wnid)."
)
_CORES = flags.DEFINE_list("cores", ["1", "2"], "Core counts to pin each measurement to.")
_BATCH = flags.DEFINE_integer("batch", 64, "Host batch.")
_SECONDS = flags.DEFINE_float("seconds", 3.0, "Seconds of each steady-state window.")
_WINDOWS = flags.DEFINE_integer("windows", 5, "Steady-state windows per measurement.")
_PATHS = flags.DEFINE_list("paths", ["train", "eval", "imagenet_c"], "Pipelines to time.")
_DATA_DIR = flags.DEFINE_string(
    "data_dir", "", "Where to make (or reuse) the data set; default: a temporary folder."
)
_MEASURE = flags.DEFINE_string(
    "measure", "", "Internal: PATH,SIDE,CORES, one measurement printed as a JSON line."
)

SIDES = ("ours", "official")
CORRUPTION, SEVERITY = "gaussian_noise", 3
QUALITY = 90
# docs/speed.md, "GPU: one H200" (commit cef57ea, lease of 2026-12-04), bfloat16 median step
# times read by hand: name -> (images per step, seconds per step).
H200_STEPS = {
    "DeiT-S plain, batch 256": (256, 34.0e-3),
    "DeiT-S RSPC, batch 256": (256, 64.7e-3),
    "RVT-S* plain, batch 128": (128, 34.9e-3),
    "RVT-S* RSPC, batch 128": (128, 63.2e-3),
    "XCiT-S12 plain, batch 128": (128, 50.4e-3),
    "XCiT-S12 RSPC, batch 128": (128, 90.6e-3),
}


# ----------------------------------------------------------------------------
# The data set
# ----------------------------------------------------------------------------


def photographs() -> list[np.ndarray]:
    """RGB uint8 photographs that ship inside installed packages."""
    try:
        from skimage import data

        names = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field")
        names += ("immunohistochemistry", "retina")
        return [getattr(data, name)()[..., :3] for name in names]
    except ImportError:
        from sklearn.datasets import load_sample_images

        return list(load_sample_images().images)


def jpeg(photo: np.ndarray, rng: np.random.Generator, size: tuple[int, int] | None = None) -> bytes:
    """A random crop of `photo` (half to all of its area) rescaled to `size` (width, height;
    default 500 x 375 to 640 x 480, a fifth portrait) and encoded at QUALITY."""
    from PIL import Image

    if size is None:
        width = int(rng.integers(500, 641))
        height = round(width * rng.uniform(0.66, 0.8))
        size = (height, width) if rng.random() < 0.2 else (width, height)
    h, w = photo.shape[:2]
    aspect = size[0] / size[1]
    area = rng.uniform(0.5, 1.0) * h * w
    crop_w = min(w, round(math.sqrt(area * aspect)))
    crop_h = min(h, round(crop_w / aspect))
    top, left = rng.integers(0, h - crop_h + 1), rng.integers(0, w - crop_w + 1)
    image = Image.fromarray(photo[top : top + crop_h, left : left + crop_w])
    image = image.resize(size, Image.BICUBIC)
    if rng.random() < 0.5:
        image = image.transpose(Image.FLIP_LEFT_RIGHT)
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=QUALITY)
    return out.getvalue()


def _tar_add(tar: tarfile.TarFile, name: str, payload: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(payload)
    tar.addfile(info, io.BytesIO(payload))


def _write(path: pathlib.Path, payload: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(payload)


def imagenet_wnids() -> list[str]:
    """The 1000 wnids in tfds's (and ImageFolder's) order."""
    from tensorflow_datasets.datasets.imagenet2012 import imagenet_common

    return imagenet_common.label_names_file().read_text().split()


def validation_wnids(count: int) -> list[str]:
    """The wnids tfds gives ILSVRC2012_val_00000001 .. count (its bundled label list)."""
    import tensorflow_datasets as tfds

    path = tfds.core.tfds_path("datasets/imagenet2012/validation_labels.txt")
    return path.read_text().split()[:count]


def layout_of(root: pathlib.Path) -> dict:
    """The folders of the data set under `root`: the tfds data dir, the ImageFolders and the
    ImageNet-C root."""
    return {
        "tfds": root / "tfds",
        "train": root / "folders" / "train",
        "val": root / "folders" / "val",
        "imagenet_c": root / "imagenet_c",
    }


def make_dataset(root: pathlib.Path, images: int, classes: int, val_images: int, c_images: int):
    """Writes the three layouts under `root` (module docstring) and builds tfds imagenet2012
    from the tars in `root/tfds`; returns {'tfds', 'train', 'val', 'imagenet_c'} folders."""
    if c_images < 1000:
        raise app.UsageError("--c_images must be >= 1000: ImageNet-C has a folder per wnid")
    layout = layout_of(root)
    done = root / "complete.json"
    wanted = dict(images=images, classes=classes, val_images=val_images, c_images=c_images)
    if done.exists() and json.loads(done.read_text()) == wanted:
        return layout
    if root.exists() and any(root.iterdir()):  # never overwrite or mix with other files
        raise app.UsageError(
            f"--data_dir={root} holds other files or another size of this data set "
            f"({done.name}: {done.read_text() if done.exists() else 'none'}); pass a new or "
            "empty folder"
        )
    photos = photographs()
    rng = np.random.default_rng(0)
    wnids = imagenet_wnids()
    manual = layout["tfds"] / "downloads" / "manual"
    manual.mkdir(parents=True, exist_ok=True)
    with tarfile.open(manual / "ILSVRC2012_img_train.tar", "w") as train_tar:
        for c, wnid in enumerate(wnids[:classes]):
            inner = io.BytesIO()
            with tarfile.open(fileobj=inner, mode="w") as class_tar:
                for i in range(c, images, classes):
                    name = f"{wnid}_{i}.JPEG"
                    payload = jpeg(photos[i % len(photos)], rng)
                    _tar_add(class_tar, name, payload)
                    _write(layout["train"] / wnid / name, payload)
            _tar_add(train_tar, f"{wnid}.tar", inner.getvalue())
    with tarfile.open(manual / "ILSVRC2012_img_val.tar", "w") as val_tar:
        for i, wnid in enumerate(validation_wnids(val_images)):
            name = f"ILSVRC2012_val_{i + 1:08d}.JPEG"
            payload = jpeg(photos[i % len(photos)], rng)
            _tar_add(val_tar, name, payload)
            _write(layout["val"] / wnid / name, payload)
    c_root = layout["imagenet_c"] / CORRUPTION / str(SEVERITY)
    for i in range(c_images):
        name = f"ILSVRC2012_val_{i + 1:08d}.JPEG"
        _write(c_root / wnids[i % 1000] / name, jpeg(photos[i % len(photos)], rng, (224, 224)))
    build_tfds(layout["tfds"])
    done.write_text(json.dumps(wanted))
    return layout


def build_tfds(data_dir: pathlib.Path) -> None:
    """README's recipe: `tfds build imagenet2012` on the manual-download tars."""
    import tensorflow_datasets as tfds

    builder = tfds.builder("imagenet2012", data_dir=str(data_dir))
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(
            manual_dir=str(data_dir / "downloads" / "manual")
        )
    )


# ----------------------------------------------------------------------------
# One measurement (in its own pinned process)
# ----------------------------------------------------------------------------


def pin(cores: int) -> None:
    """This process (and the threads and processes it starts) on its first `cores` cores."""
    allowed = sorted(os.sched_getaffinity(0))
    if cores > len(allowed):
        raise app.UsageError(f"--cores={cores}: this process may run on {len(allowed)} cores only")
    os.sched_setaffinity(0, allowed[:cores])


def timed(batches, pass_images: int, seconds: float, windows: int) -> dict:
    """Images/s of the first pass (from calling `batches`, an infinite iterator of
    batch image counts, to `pass_images` images) and of `windows` windows after it."""
    start = time.perf_counter()
    stream = batches()
    count = 0
    while count < pass_images:
        count += next(stream)
    first = count / (time.perf_counter() - start)
    rates = []
    for _ in range(windows):
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            count += next(stream)
        rates.append(count / (time.perf_counter() - start))
    return dict(first=first, steady=statistics.median(rates), windows=rates)


def recipe():
    """The DeiT/RVT ImageNet recipe of the project's configs (configs/deit_s.py and the
    RVT configs apply it)."""
    from rspc_jax.training import defaults, recipes

    config = defaults.get_default_config()
    recipes.apply_imagenet_recipe(config, batch_size=1024, per_device_batch=128)
    return config


def ours(path: str, layout: dict, batch: int):
    """(fn() -> iterator of batch image counts, images in one pass) of our pipeline."""
    from rspc_jax.data import eval as eval_data
    from rspc_jax.data import specs, train

    config = recipe()
    size = config.image_size
    if path == "train":
        count = _images_of(layout["train"])

        def batches():
            iterator = train.train_iterator(
                dataset=config.dataset,
                data_dir=str(layout["tfds"]),
                split="train",
                image_size=size,
                local_batch_size=batch,
                seed=0,
                **train.recipe_args(config),
                process_index=0,
                process_count=1,
            )
            for example in iterator:
                yield len(example["label"])

        return batches, count // batch * batch

    from rspc_jax.evaluation import loop, sources

    spec = specs.dataset_spec(config.dataset)
    if path == "eval":

        def examples():
            return eval_data.eval_examples(
                dataset=config.dataset,
                data_dir=str(layout["tfds"]),
                split="validation",
                image_size=size,
                eval_preprocess=config.eval_preprocess,
                process_index=0,
                process_count=1,
            )

        count = _images_of(layout["val"])
    else:
        root = layout["imagenet_c"]
        paths, labels = sources.imagenet_c_examples(root, CORRUPTION, SEVERITY)
        count = len(paths)

        def examples():
            return eval_data.file_examples(
                paths,
                labels,
                image_size=size,
                preprocess=eval_data.crop_only,
                process_index=0,
                process_count=1,
            )

    def batches():
        while True:  # the evaluation loop's passes: Context.batches without the mesh
            ds, largest = examples()
            source, largest = loop.as_source(ds, largest)
            for out in eval_data.host_batches(
                source,
                local_batch=batch,
                batches=eval_data.num_batches(largest, batch),
                image_shape=(size, size, 3),
                mean=spec.mean,
                std=spec.std,
                normalise=False,  # as the loop: the accelerator normalises
            ):
                yield int(out["mask"].sum())

    return batches, count


def patch_timm_posterize() -> bool:
    """timm's posterize op returns a black image at 0 bits (older Pillow's result) where
    the installed Pillow refuses `ImageOps.posterize(img, 0)`; True if it patched."""
    from PIL import Image, ImageOps
    from timm.data import auto_augment

    try:
        ImageOps.posterize(Image.new("RGB", (2, 2)), 0)
        return False
    except ValueError:
        pass
    original = auto_augment.posterize

    def posterize(img, bits_to_keep, **kwargs):
        if bits_to_keep <= 0:
            return Image.new(img.mode, img.size)
        return original(img, bits_to_keep, **kwargs)

    for name, op in auto_augment.NAME_TO_OP.items():
        if op is original:
            auto_augment.NAME_TO_OP[name] = posterize
    return True


def official(path: str, layout: dict, batch: int, cores: int):
    """(fn() -> iterator of batch image counts, images in one pass) of the official
    loader: DeiT's/RVT's transforms on an ImageFolder in a DataLoader."""
    from timm.data import create_transform
    from timm.data.constants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
    import torch
    from torchvision import datasets, transforms

    config = recipe()
    size = config.image_size
    if path == "train":  # DeiT's build_transform(is_train=True) with its defaults
        transform = create_transform(
            input_size=size,
            is_training=True,
            color_jitter=0.4,
            auto_augment=config.rand_augment,
            interpolation="bicubic",
            re_prob=config.random_erase_prob,
            re_mode="pixel",
            re_count=1,
        )
        folder = layout["train"]
    elif path == "eval":  # DeiT's build_transform(is_train=False)
        transform = transforms.Compose(
            [
                transforms.Resize(int(size / 0.875), interpolation=3),
                transforms.CenterCrop(size),
                transforms.ToTensor(),
                transforms.Normalize(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD),
            ]
        )
        folder = layout["val"]
    else:  # RVT's ImageNet-C loop, one folder per (corruption, severity)
        transform = transforms.Compose(
            [
                transforms.CenterCrop(size),
                transforms.ToTensor(),
                transforms.Normalize(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD),
            ]
        )
        folder = layout["imagenet_c"] / CORRUPTION / str(SEVERITY)
    torch.set_num_threads(cores)

    def batches():
        while True:  # a loader per pass, as the official loops iterate theirs
            dataset = datasets.ImageFolder(str(folder), transform=transform)
            loader = torch.utils.data.DataLoader(
                dataset,
                batch_size=batch,
                shuffle=path == "train",
                num_workers=cores,
                drop_last=path == "train",
            )
            for images, _ in loader:
                yield len(images)

    count = _images_of(folder)
    return batches, count // batch * batch if path == "train" else count


def _images_of(folder: pathlib.Path) -> int:
    return sum(1 for _ in folder.rglob("*.JPEG"))


def measure(spec: str, layout: dict) -> dict:
    path, side, cores = spec.split(",")
    cores = int(cores)
    pin(cores)
    patched = False
    if side == "ours":
        batches, count = ours(path, layout, _BATCH.value)
    else:
        patched = patch_timm_posterize()
        batches, count = official(path, layout, _BATCH.value, cores)
    record = timed(batches, count, _SECONDS.value, _WINDOWS.value)
    return dict(record, path=path, side=side, cores=cores, images=count, patched=patched)


def run_measurement(path: str, side: str, cores: int, root: pathlib.Path) -> dict:
    """One measurement in a fresh process, with TF's and the BLAS pools at `cores` threads."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(cores),
        TF_NUM_INTEROP_THREADS=str(cores),
        TF_NUM_INTRAOP_THREADS=str(cores),
        TF_CPP_MIN_LOG_LEVEL="2",
    )
    command = [
        sys.executable,
        "-m",
        "benchmarks.input_pipeline",
        f"--measure={path},{side},{cores}",
        f"--data_dir={root}",
        f"--batch={_BATCH.value}",
        f"--seconds={_SECONDS.value}",
        f"--windows={_WINDOWS.value}",
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"{path} {side} on {cores} cores failed:\n{tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------
# The tables
# ----------------------------------------------------------------------------

ROW_NAMES = {
    "train": "train (crop, flip, RandAugment, erasing)",
    "eval": "eval (resize 256, crop 224)",
    "imagenet_c": "ImageNet-C folder (crop 224)",
}


def print_tables(results: list[dict], cores: list[int]) -> None:
    by = {(r["path"], r["side"], r["cores"]): r for r in results}
    paths = [p for p in ROW_NAMES if any(key[0] == p for key in by)]
    width = max(len(ROW_NAMES[p]) for p in paths) + 1
    print(
        f"\n{'images/s':<{width}} {'cores':>5} {'ours first':>11} {'official first':>15} "
        f"{'ours steady':>12} {'official steady':>16} {'ours/official':>14} "
        f"{'ours/core':>10} {'official/core':>14}"
    )
    for path in paths:
        for n in cores:
            o, f = by[(path, "ours", n)], by[(path, "official", n)]
            print(
                f"{ROW_NAMES[path]:<{width}} {n:>5} {o['first']:>11.1f} {f['first']:>15.1f} "
                f"{o['steady']:>12.1f} {f['steady']:>16.1f} {o['steady'] / f['steady']:>14.2f} "
                f"{o['steady'] / n:>10.1f} {f['steady'] / n:>14.1f}"
            )
    print(
        "first: images of one pass over the files (an epoch for training) over the seconds "
        "from building the pipeline to its end; steady: the median images/s of the windows "
        "after it; ours/official: of the steady rates; /core: steady over the pinned cores."
    )
    if any(r["patched"] for r in results):
        print(
            "official: the installed Pillow refuses ImageOps.posterize(img, 0), so timm's "
            "PosterizeIncreasing at magnitude 10 returned a black image (patched, as Pillow "
            "< 13 does; requirements-torch.txt pins Pillow 12.3.0)."
        )
    if "train" not in paths:
        return
    print(
        "\nhost cores that would feed the H200 steps of docs/speed.md (H200_STEPS, read by "
        "hand) at the training rate per core measured with N cores:"
    )
    columns = [f"ours N={n}" for n in cores] + [f"official N={n}" for n in cores]
    width = max(len(name) for name in H200_STEPS) + 1
    print(f"{'step':<{width}} {'images/s':>9} " + " ".join(f"{c:>13}" for c in columns))
    for name, (images, seconds) in H200_STEPS.items():
        rate = images / seconds
        needed = [rate / (by[("train", side, n)]["steady"] / n) for side in SIDES for n in cores]
        print(f"{name:<{width}} {rate:>9.0f} " + " ".join(f"{c:>13.1f}" for c in needed))


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    if _MEASURE.value:
        print(json.dumps(measure(_MEASURE.value, layout_of(pathlib.Path(_DATA_DIR.value)))))
        return
    cores = [int(n) for n in _CORES.value]
    unknown = set(_PATHS.value) - set(ROW_NAMES)
    if unknown:
        raise app.UsageError(f"unknown --paths {sorted(unknown)}; choose from {list(ROW_NAMES)}")
    with tempfile.TemporaryDirectory() as scratch:
        root = pathlib.Path(_DATA_DIR.value or scratch)
        start = time.perf_counter()
        make_dataset(root, _IMAGES.value, _CLASSES.value, _VAL_IMAGES.value, _C_IMAGES.value)
        print(
            f"data set in {root}: {_IMAGES.value} training images of {_CLASSES.value} classes, "
            f"{_VAL_IMAGES.value} validation images, {_C_IMAGES.value} ImageNet-C images "
            f"({CORRUPTION}/{SEVERITY}); made in {time.perf_counter() - start:.0f} s"
        )
        results = []
        for path in _PATHS.value:
            for n in cores:
                for side in SIDES:
                    results.append(run_measurement(path, side, n, root))
                    r = results[-1]
                    print(
                        f"{path} {side} {n} cores: first {r['first']:.1f}, steady "
                        f"{r['steady']:.1f} images/s over {r['images']} images a pass",
                        flush=True,
                    )
        print(
            f"\nbatch {_BATCH.value}, {_WINDOWS.value} steady windows of {_SECONDS.value} s, "
            f"one measurement at a time, each process pinned to its cores"
        )
        print_tables(results, cores)


if __name__ == "__main__":
    app.run(main)
