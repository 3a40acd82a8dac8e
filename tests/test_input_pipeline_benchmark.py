"""benchmarks/input_pipeline.py on a tiny data set: the command prints its tables with a
positive rate in every row, the layouts it writes are what our readers and the official
ImageFolders read, and the official side runs timm's PosterizeIncreasing at magnitude 10."""

import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import run_python, skip_without

ROOT = pathlib.Path(__file__).resolve().parents[1]

IMAGES, CLASSES, VAL_IMAGES, C_IMAGES = 40, 2, 20, 1000


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(printed output, data folder) of one tiny run on 1 core."""
    skip_without("timm")  # the official side (requirements-torch.txt)
    data = tmp_path_factory.mktemp("input_pipeline")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.input_pipeline",
            f"--images={IMAGES}",
            f"--classes={CLASSES}",
            f"--val_images={VAL_IMAGES}",
            f"--c_images={C_IMAGES}",
            "--cores=1",
            "--batch=8",
            "--seconds=0.2",
            "--windows=2",
            f"--data_dir={data}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, data


def test_tables_have_positive_rates(run):
    from benchmarks import input_pipeline

    out, _ = run
    names = tuple(input_pipeline.ROW_NAMES.values())
    rows = [line for line in out.splitlines() if line.startswith(names)]
    assert len(rows) == 3, out
    for row, name in zip(rows, names):
        assert row.split()[len(name.split())] == "1", row  # cores
        rates = [float(x) for x in re.findall(r"\d+\.\d+", row)]
        assert len(rates) == 7 and all(r > 0 for r in rates), row
    feeding = out.split("host cores that would feed")[1].splitlines()[2:]
    assert [line.split(",")[0] for line in feeding][:2] == ["DeiT-S plain", "DeiT-S RSPC"]
    for line in feeding:
        assert all(float(x) > 0 for x in line.split()[-3:]), line


def test_layouts_are_what_the_readers_read(run):
    import tensorflow_datasets as tfds

    from benchmarks import input_pipeline
    from rspc_jax.evaluation import sources

    _, data = run
    layout = input_pipeline.layout_of(data)
    info = tfds.builder("imagenet2012", data_dir=str(layout["tfds"])).info
    assert info.splits["train"].num_examples == IMAGES
    assert info.splits["validation"].num_examples == VAL_IMAGES
    paths, labels = sources.image_folder_examples(layout["train"])
    assert len(paths) == IMAGES and sorted(set(labels)) == list(range(CLASSES))
    wnids = input_pipeline.imagenet_wnids()
    assert sorted(p.name for p in layout["train"].iterdir()) == wnids[:CLASSES]
    val, _ = sources.image_folder_examples(layout["val"])
    assert len(val) == VAL_IMAGES
    paths, labels = sources.imagenet_c_examples(
        layout["imagenet_c"], input_pipeline.CORRUPTION, input_pipeline.SEVERITY
    )
    assert len(paths) == C_IMAGES and sorted(set(labels)) == list(range(1000))

    from PIL import Image

    sizes = {Image.open(p).size for p in list(layout["train"].rglob("*.JPEG"))}
    assert all(500 <= max(s) <= 640 and 330 <= min(s) <= 512 for s in sizes), sizes
    assert {Image.open(p).size for p in paths[:20]} == {(224, 224)}


def test_profile_prints_each_stage_of_both_sides(run):
    """benchmarks/input_profile on the same tiny data set: every stage and RandAugment op has
    a time on both sides, and each table's total is the sum of its stages."""
    _, data = run
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.input_profile", f"--data_dir={data}"]
        + [f"--images={IMAGES}", f"--classes={CLASSES}", f"--val_images={VAL_IMAGES}"]
        + [f"--c_images={C_IMAGES}", "--timed=4", "--warmup=2", "--op_images=3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    from benchmarks import input_profile

    lines = done.stdout.splitlines()
    for title, stages in (
        ("training", input_profile.TRAIN_STAGES),
        ("evaluation", input_profile.EVAL_STAGES),
    ):
        start = next(i for i, line in enumerate(lines) if line.startswith(title + " (ms"))
        rows = lines[start + 2 : start + 3 + len(stages)]
        assert [r[:28].strip() for r in rows] == [*stages, "total"], rows
        values = np.array([[float(x) for x in r[28:].split()] for r in rows])
        np.testing.assert_allclose(values[:-1, :2].sum(0), values[-1, :2], atol=0.02)
        assert (values[-1, :2] > 0).all(), rows
    ops = [
        line.split()
        for line in lines
        if line.split()[:1] and line.split()[0] in input_profile._OP_NAMES
    ]
    assert [op[0] for op in ops] == input_profile._OP_NAMES, ops
    assert all(float(op[2]) > 0 for op in ops), ops  # official: a PIL op always costs something


_POSTERIZE = """
import numpy as np
from PIL import Image
from timm.data import auto_augment

from benchmarks import input_pipeline

input_pipeline.patch_timm_posterize()
op = auto_augment.AugmentOp("PosterizeIncreasing", prob=1.0, magnitude=10)
image = Image.fromarray(np.full((8, 8, 3), 200, np.uint8))
print("max", np.asarray(op(image)).max())
"""


def test_official_posterize_at_magnitude_10():
    """timm's PosterizeIncreasing at magnitude 10 keeps 0 bits: black, not an error. In a
    fresh process: timm must not be imported where JAX and TensorFlow are (conftest)."""
    skip_without("timm")
    done = run_python(["-c", _POSTERIZE])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["max", "0"], done.stdout
