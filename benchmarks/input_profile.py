"""Where the input pipelines' time goes: milliseconds per image of each stage, ours against
the official loader's, one image at a time on one pinned core, on the files that
benchmarks/input_pipeline.py makes.

    python -m benchmarks.input_profile --data_dir=/tmp/input_data

(--data_dir: where benchmarks/input_pipeline made its data set with the same --images,
--classes, --val_images and --c_images; made there if it is new or empty.)

Each side runs in its own process pinned to one core (TF's pools at one thread, PyTorch at
one thread, no workers), so a stage's cost is its CPU time per image, not a parallel rate.
The stages are cumulative: each row times the pipeline up to and including that stage over
the same --images files, and the table gives the difference to the row above. Training:
read + decode, inception crop + bicubic resize + flip, RandAugment (rand-m9-mstd0.5-inc1),
normalise, random erasing 0.25. Evaluation: read + decode, resize 256 (bicubic) + centre
crop 224, normalise. Our host normalises nothing (it hands the accelerator uint8 images, which
`data.on_device` normalises) and draws only the erasing box and its noise key (the
accelerator fills it): those two rows are what our host does instead, the cast to uint8 and
the box's draws. Then each RandAugment op alone at magnitude 9 on 224 x 224 crops (ours:
`augment.apply_op` in a tf.data map, less the same map without it; official: timm's op on a
PIL image), the cost of an op when it is drawn.

Ours is the library's own functions (`data.train`, `data.augment`, `data.eval`) in a tf.data
map over file paths; official is timm's transforms (DeiT's `create_transform`, torchvision's
eval transforms) called in a Python loop, as a DataLoader worker calls them.
"""

import json
import os
import pathlib
import subprocess
import sys
import time

from absl import app, flags
import numpy as np

from benchmarks import input_pipeline

# --data_dir, --images, --classes, --val_images, --c_images: benchmarks/input_pipeline's flags
# (the data set it makes, or reuses where it exists).
_TIMED = flags.DEFINE_integer("timed", 300, "Images timed per stage (after --warmup).")
_WARMUP = flags.DEFINE_integer("warmup", 30, "Images run before timing each stage.")
_OP_IMAGES = flags.DEFINE_integer("op_images", 100, "Images timed per RandAugment op.")
_SIDE = flags.DEFINE_string("side", "", "Internal: 'ours' or 'official', printed as JSON.")

MAGNITUDE = 9
TRAIN_STAGES = (
    "read + decode",
    "crop + resize + flip",
    "RandAugment",
    "normalise (ours: to uint8)",
    "erasing (ours: the box)",
)
EVAL_STAGES = ("read + decode", "resize 256 + crop 224", "normalise (ours: none)")


def _files(layout: dict, split: str, count: int) -> list[str]:
    return sorted(str(p) for p in layout[split].rglob("*.JPEG"))[:count]


def _per_image_ms(run, count: int, warmup: int) -> float:
    """Milliseconds per image of `run(n)`, which processes n images, after a warm-up."""
    run(warmup)
    start = time.process_time()
    run(count)
    return 1e3 * (time.process_time() - start) / count


# ----------------------------------------------------------------------------
# Ours
# ----------------------------------------------------------------------------


def _ours_train_stage(depth: int):
    """fn(path, key) -> image: the training preprocessing up to stage `depth` (1-based)."""
    import tensorflow as tf

    from rspc_jax.data import augment, train
    from rspc_jax.data import eval as eval_data

    config = input_pipeline.recipe()
    size = config.image_size
    crop = train._train_preprocess(config.augment, config.dataset)
    fold_in = tf.random.experimental.stateless_fold_in

    def prepare(path, key):
        image = tf.io.decode_jpeg(tf.io.read_file(path), channels=3)
        if depth >= 2:
            image = crop(image, key, size)
        if depth >= 3:
            image = augment.rand_augment(image, fold_in(key, 1), config.rand_augment)
        if depth >= 4:
            image = eval_data.as_uint8(image, size)
        if depth >= 5:
            box = augment.erasing_box(image.shape, fold_in(key, 2), config.random_erase_prob)
            return image, box
        return image

    return prepare


def _ours_eval_stage(depth: int):
    import tensorflow as tf

    from rspc_jax.data import eval as eval_data

    config = input_pipeline.recipe()
    size = config.image_size

    def prepare(path, key):
        del key
        image = tf.io.decode_jpeg(tf.io.read_file(path), channels=3)
        if depth >= 2:
            image = eval_data.as_uint8(eval_data.imagenet(image, size), size)
        return image  # depth 3: the accelerator normalises (data.on_device)

    return prepare


def _ours_map_ms(paths, prepare, count: int, warmup: int) -> float:
    import tensorflow as tf

    keys = np.stack([np.arange(len(paths)), np.zeros(len(paths))], 1).astype(np.int64)
    ds = tf.data.Dataset.from_tensor_slices((paths, keys)).repeat().map(prepare)
    iterator = iter(ds)

    def run(n):
        for _ in range(n):
            next(iterator)

    return _per_image_ms(run, count, warmup)


def _ours_ops_ms(crops: np.ndarray, count: int) -> dict:
    """Each op in a tf.data map, as the pipeline runs it, less the same map's identity."""
    import tensorflow as tf

    from rspc_jax.data import augment

    def per_image_ms(fn):
        ds = tf.data.Dataset.from_tensor_slices(crops.astype(np.float32)).repeat().map(fn)
        iterator = iter(ds)

        def run(n):
            for _ in range(n):
                next(iterator)

        return _per_image_ms(run, count, 5)

    baseline = per_image_ms(lambda image: image)
    return {
        name: per_image_ms(lambda image, name=name: augment.apply_op(image, name, MAGNITUDE))
        - baseline
        for name in _OP_NAMES
    }


def ours(layout: dict) -> dict:
    import tensorflow as tf

    count, warmup = _TIMED.value, _WARMUP.value
    train_files = _files(layout, "train", count + warmup)
    val_files = _files(layout, "val", count + warmup)
    train = [
        _ours_map_ms(train_files, _ours_train_stage(d + 1), count, warmup)
        for d in range(len(TRAIN_STAGES))
    ]
    evaluation = [
        _ours_map_ms(val_files, _ours_eval_stage(d + 1), count, warmup)
        for d in range(len(EVAL_STAGES))
    ]
    crop = _ours_train_stage(2)
    crops = np.stack(
        [
            crop(tf.constant(p), tf.constant([i, 0], tf.int64)).numpy()
            for i, p in enumerate(train_files[: _OP_IMAGES.value])
        ]
    )
    crops = np.round(np.clip(crops, 0, 255))
    return dict(train=train, eval=evaluation, ops=_ours_ops_ms(crops, _OP_IMAGES.value))


# ----------------------------------------------------------------------------
# Official
# ----------------------------------------------------------------------------


def _official_train_stages():
    """DeiT's create_transform(is_training=True) split into the stages of TRAIN_STAGES."""
    from timm.data import create_transform

    config = input_pipeline.recipe()
    full = create_transform(
        input_size=config.image_size,
        is_training=True,
        color_jitter=0.4,
        auto_augment=config.rand_augment,
        interpolation="bicubic",
        re_prob=config.random_erase_prob,
        re_mode="pixel",
        re_count=1,
    )
    # timm's order: RandomResizedCrop, flip, RandAugment, ToTensor, Normalize, RandomErasing.
    crop, flip, rand_augment, to_tensor, normalise, erase = full.transforms
    return [[], [crop, flip], [rand_augment], [to_tensor, normalise], [erase]]


def _official_eval_stages():
    from timm.data.constants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
    from torchvision import transforms

    size = input_pipeline.recipe().image_size
    return [
        [],
        [transforms.Resize(int(size / 0.875), interpolation=3), transforms.CenterCrop(size)],
        [transforms.ToTensor(), transforms.Normalize(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)],
    ]


def _official_ms(paths, stages, depth: int, count: int, warmup: int) -> float:
    from PIL import Image

    ops = [op for stage in stages[:depth] for op in stage]
    cursor = [0]

    def run(n):
        for _ in range(n):
            with open(paths[cursor[0] % len(paths)], "rb") as f:
                image = Image.open(f).convert("RGB")  # torchvision's pil_loader
            for op in ops:
                image = op(image)
            cursor[0] += 1

    return _per_image_ms(run, count, warmup)


def _official_ops_ms(crops: np.ndarray, count: int) -> dict:
    from PIL import Image
    from timm.data import auto_augment

    images = [Image.fromarray(c.astype(np.uint8)) for c in crops]
    hparams = dict(translate_const=100, img_mean=(124, 116, 104), magnitude_std=0.0)
    results = {}
    for name in auto_augment.NAME_TO_OP:
        if name not in _OP_NAMES:
            continue
        op = auto_augment.AugmentOp(name, prob=1.0, magnitude=MAGNITUDE, hparams=hparams)

        def run(n, op=op):
            for i in range(n):
                op(images[i % len(images)])

        results[name] = _per_image_ms(run, count, 5)
    return results


_OP_NAMES = (
    "AutoContrast Equalize Invert Rotate Posterize PosterizeIncreasing Solarize "
    "SolarizeIncreasing SolarizeAdd Color ColorIncreasing Contrast ContrastIncreasing "
    "Brightness BrightnessIncreasing Sharpness SharpnessIncreasing ShearX ShearY "
    "TranslateXRel TranslateYRel"
).split()


def official(layout: dict) -> dict:
    import torch

    torch.set_num_threads(1)
    input_pipeline.patch_timm_posterize()
    count, warmup = _TIMED.value, _WARMUP.value
    train_files = _files(layout, "train", count + warmup)
    val_files = _files(layout, "val", count + warmup)
    train_stages, eval_stages = _official_train_stages(), _official_eval_stages()
    train = [
        _official_ms(train_files, train_stages, d + 1, count, warmup)
        for d in range(len(TRAIN_STAGES))
    ]
    evaluation = [
        _official_ms(val_files, eval_stages, d + 1, count, warmup) for d in range(len(EVAL_STAGES))
    ]
    from PIL import Image

    crop = train_stages[1][0]
    crops = []
    for path in train_files[: _OP_IMAGES.value]:
        with open(path, "rb") as f:
            crops.append(np.asarray(crop(Image.open(f).convert("RGB"))))
    return dict(
        train=train, eval=evaluation, ops=_official_ops_ms(np.stack(crops), _OP_IMAGES.value)
    )


# ----------------------------------------------------------------------------
# The tables
# ----------------------------------------------------------------------------


def run_side(side: str, root: pathlib.Path) -> dict:
    """One side in a fresh process pinned to one core, its pools at one thread."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TF_NUM_INTEROP_THREADS="1",
        TF_NUM_INTRAOP_THREADS="1",
        TF_CPP_MIN_LOG_LEVEL="2",
    )
    command = [sys.executable, "-m", "benchmarks.input_profile", f"--side={side}"]
    command += [f"--data_dir={root}", f"--timed={_TIMED.value}", f"--warmup={_WARMUP.value}"]
    command += [f"--op_images={_OP_IMAGES.value}"]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"the {side} profile failed:\n{tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def stage_table(title: str, stages, ours_ms, official_ms) -> list[str]:
    """Cumulative stage times as per-stage differences, ours against official."""
    lines = [
        f"\n{title} (ms per image, one core)",
        f"{'stage':<28} {'ours':>8} {'official':>9} {'ours - official':>16}",
    ]
    previous = (0.0, 0.0)
    for name, o, f in zip(stages, ours_ms, official_ms):
        own, theirs = o - previous[0], f - previous[1]
        lines.append(f"{name:<28} {own:>8.2f} {theirs:>9.2f} {own - theirs:>16.2f}")
        previous = (o, f)
    total = ours_ms[-1] - official_ms[-1]
    lines.append(f"{'total':<28} {ours_ms[-1]:>8.2f} {official_ms[-1]:>9.2f} {total:>16.2f}")
    return lines


def ops_table(ours_ops: dict, official_ops: dict) -> list[str]:
    lines = [
        f"\nRandAugment ops at magnitude {MAGNITUDE} on 224 x 224 crops (ms per image when drawn)",
        f"{'op':<22} {'ours':>8} {'official':>9} {'ours/official':>14}",
    ]
    for name in _OP_NAMES:
        o, f = ours_ops[name], official_ops[name]
        lines.append(f"{name:<22} {o:>8.3f} {f:>9.3f} {o / f:>14.1f}")
    mean_o = sum(ours_ops[n] for n in _OP_NAMES) / len(_OP_NAMES)
    mean_f = sum(official_ops[n] for n in _OP_NAMES) / len(_OP_NAMES)
    lines.append(
        f"{'mean (a uniform draw)':<22} {mean_o:>8.3f} {mean_f:>9.3f} {mean_o / mean_f:>14.1f}"
    )
    return lines


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    if not input_pipeline._DATA_DIR.value:
        raise app.UsageError("pass --data_dir (made there by benchmarks/input_pipeline if new)")
    root = pathlib.Path(input_pipeline._DATA_DIR.value).resolve()
    layout = input_pipeline.layout_of(root)
    if _SIDE.value:
        input_pipeline.pin(1)
        print(json.dumps(ours(layout) if _SIDE.value == "ours" else official(layout)))
        return
    input_pipeline.make_dataset(
        root,
        input_pipeline._IMAGES.value,
        input_pipeline._CLASSES.value,
        input_pipeline._VAL_IMAGES.value,
        input_pipeline._C_IMAGES.value,
    )
    mine, theirs = run_side("ours", root), run_side("official", root)
    lines = stage_table("training", TRAIN_STAGES, mine["train"], theirs["train"])
    lines += stage_table("evaluation", EVAL_STAGES, mine["eval"], theirs["eval"])
    lines += ops_table(mine["ops"], theirs["ops"])
    print("\n".join(lines))
    print(
        f"\n{_TIMED.value} images per stage after {_WARMUP.value} of warm-up, CPU time of one "
        "process pinned to one core; each row is the cumulative time up to that stage minus "
        "the row above."
    )


if __name__ == "__main__":
    app.run(main)
