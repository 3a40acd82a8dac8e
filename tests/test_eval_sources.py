"""Readers of the released benchmark layouts, on small generated folders (docs/evaluation.md, benchmark sections)."""

from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest

from rspc_jax.evaluation import protocols as P
from rspc_jax.evaluation import sources as S

FAKE_WNIDS = [f"n{i:08d}" for i in range(1000)]


def touch(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()


def make_wnid_tree(root: Path, suffix: str, num_classes: int = 1000) -> None:
    """One empty file per class folder: the readers list files, they do not decode them."""
    for wnid in FAKE_WNIDS[:num_classes]:
        touch(root / wnid / f"ILSVRC2012_val_00000001{suffix}")


def test_image_folder_labels_follow_sorted_folder_order(tmp_path):
    for name in ("zebra/b.JPEG", "zebra/a.png", "zebra/notes.txt", "ant/x.jpg", "moth/y.PNG"):
        touch(tmp_path / name)
    paths, labels = S.image_folder_examples(tmp_path)
    names = [Path(p).relative_to(tmp_path).as_posix() for p in paths]
    assert names == ["ant/x.jpg", "moth/y.PNG", "zebra/a.png", "zebra/b.JPEG"]
    assert labels.dtype == np.int64
    np.testing.assert_array_equal(labels, [0, 1, 2, 2])


def test_image_folder_rejects_empty_class(tmp_path):
    touch(tmp_path / "ant" / "x.jpg")
    (tmp_path / "bee").mkdir()
    with pytest.raises(S.MissingDataError, match="bee"):
        S.image_folder_examples(tmp_path)


def test_imagenet_c_examples(tmp_path):
    make_wnid_tree(tmp_path / "fog" / "3", ".JPEG")
    paths, labels = S.imagenet_c_examples(tmp_path, "fog", 3)
    np.testing.assert_array_equal(labels, np.arange(1000))
    assert Path(paths[7]).parent.name == FAKE_WNIDS[7]
    with pytest.raises(S.MissingDataError) as missing:
        S.imagenet_c_examples(tmp_path, "snow", 3)
    message = str(missing.value)
    assert str(tmp_path / "snow" / "3") in message and "2235448" in message
    assert "<corruption>/<severity" in message
    with pytest.raises(ValueError, match="unknown"):
        S.imagenet_c_examples(tmp_path, "fog", 0)


def test_imagenet_c_incomplete_class_list_is_an_error(tmp_path):
    make_wnid_tree(tmp_path / "fog" / "1", ".JPEG", num_classes=999)
    with pytest.raises(S.MissingDataError, match="999 class folders"):
        S.imagenet_c_examples(tmp_path, "fog", 1)


def test_subset_folder_maps_wnids_to_imagenet_indices(tmp_path):
    wnids, indices = P.IMAGENET_R_WNIDS[:3], P.IMAGENET_R_INDICES[:3]  # goldfish, shark, hammerhead
    for wnid in reversed(wnids):
        touch(tmp_path / wnid / "a.jpg")
        touch(tmp_path / wnid / "b.jpg")
    paths, labels = S.subset_folder_examples(tmp_path, wnids, indices)
    np.testing.assert_array_equal(labels, [1, 1, 2, 2, 4, 4])
    assert [Path(p).parent.name for p in paths] == [w for w in wnids for _ in range(2)]

    touch(tmp_path / "n99999999" / "c.jpg")
    with pytest.raises(ValueError, match="n99999999"):
        S.subset_folder_examples(tmp_path, wnids, indices)
    with pytest.raises(S.MissingDataError, match="1 wnid folders missing"):
        S.subset_folder_examples(tmp_path, wnids + ("n99999999", "n99999998"), [1, 2, 4, 5, 6])


def write_cifar_c(root: Path, corruption: str, images: np.ndarray, labels: np.ndarray) -> None:
    root.mkdir(parents=True, exist_ok=True)
    np.save(root / f"{corruption}.npy", images)
    np.save(root / "labels.npy", labels)


def test_cifar_c_arrays_and_severity_blocks(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(50, 32, 32, 3), dtype=np.uint8)
    labels = np.tile(rng.integers(0, 10, size=10), 5).astype(np.uint8)
    write_cifar_c(tmp_path, "glass_blur", images, labels)
    read_images, read_labels = S.cifar_c_arrays(tmp_path, "glass_blur")
    np.testing.assert_array_equal(read_images, images)
    assert read_images.dtype == np.uint8 and read_labels.dtype == np.int64
    np.testing.assert_array_equal(read_labels, labels)
    block_images, block_labels = S.cifar_c_severity(read_images, read_labels, 3)
    np.testing.assert_array_equal(block_images, images[20:30])
    np.testing.assert_array_equal(block_labels, labels[20:30])
    with pytest.raises(ValueError, match="severity"):
        S.cifar_c_severity(read_images, read_labels, 6)


def test_cifar_c_missing_file_names_path_and_source(tmp_path):
    with pytest.raises(S.MissingDataError) as missing:
        S.cifar_c_arrays(tmp_path, "elastic_transform")
    message = str(missing.value)
    assert str(tmp_path / "elastic_transform.npy") in message
    assert "2535967" in message and "3555552" in message
    assert isinstance(missing.value, FileNotFoundError)


def test_cifar_c_rejects_bad_layouts(tmp_path):
    images = np.zeros((50, 32, 32, 3), np.uint8)
    write_cifar_c(tmp_path, "fog", images, np.arange(50))  # blocks carry different labels
    with pytest.raises(ValueError, match="severity blocks"):
        S.cifar_c_arrays(tmp_path, "fog")
    write_cifar_c(tmp_path, "fog", images, np.zeros(40, np.uint8))
    with pytest.raises(ValueError, match="labels.npy"):
        S.cifar_c_arrays(tmp_path, "fog")
    write_cifar_c(tmp_path, "fog", images[:48], np.zeros(48, np.uint8))
    with pytest.raises(ValueError, match="5 severity blocks"):
        S.cifar_c_arrays(tmp_path, "fog")
    write_cifar_c(tmp_path, "fog", images.astype(np.float32), np.zeros(50, np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        S.cifar_c_arrays(tmp_path, "fog")


def test_read_video_returns_all_frames(tmp_path):
    ramp = np.linspace(0, 80, 32, dtype=np.float32)[None, :, None]
    frames = np.stack([np.broadcast_to(30 + 30 * t + ramp, (32, 32, 3)) for t in range(5)])
    frames = frames.astype(np.uint8)
    path = tmp_path / "video.mp4"
    iio.imwrite(path, frames, plugin="FFMPEG", fps=1, codec="libx264")
    video = S.read_video(path)
    assert video.shape == (5, 32, 32, 3) and video.dtype == np.uint8
    error = np.abs(video.astype(np.float32) - frames).mean(axis=(1, 2, 3))
    assert np.all(error < 4), error  # H.264 is lossy; a wrong or shuffled frame is off by >= 30


def test_read_video_missing_file(tmp_path):
    with pytest.raises(S.MissingDataError, match="3565846"):
        S.read_video(tmp_path / "none.mp4")


def test_imagenet_p_examples(tmp_path):
    make_wnid_tree(tmp_path / "translate", ".mp4")
    touch(tmp_path / "translate" / FAKE_WNIDS[0] / "ILSVRC2012_val_00000001.JPEG")  # not a video
    paths, labels = S.imagenet_p_examples(tmp_path, "translate")
    assert len(paths) == 1000 and all(p.endswith(".mp4") for p in paths)
    np.testing.assert_array_equal(labels, np.arange(1000))
    with pytest.raises(S.MissingDataError, match="3565846"):
        S.imagenet_p_examples(tmp_path, "gaussian_noise_2")
