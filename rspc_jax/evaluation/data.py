"""Host-side batches for the robustness suites: uint8 examples -> (optionally corrupted)
-> normalised, padded, masked batches that every host yields in the same number."""

from typing import Callable, Iterable, Iterator, Optional

import numpy as np

# transform(uint8 images (n, H, W, 3), labels (n,)) -> uint8 images (n, H, W, 3)
Transform = Callable[[np.ndarray, np.ndarray], np.ndarray]


def num_batches(largest_host_count: int, local_batch: int, limit: int = 0) -> int:
    """Batches per host so that the host with the most examples sees all of them
    (`limit` > 0 caps the examples per host)."""
    count = min(largest_host_count, limit) if limit else largest_host_count
    return -(-count // local_batch)


def host_batches(examples: Iterable[tuple[np.ndarray, int]], *, local_batch: int,
                 batches: int, image_shape: tuple[int, int, int], mean, std,
                 transform: Optional[Transform] = None, limit: int = 0) -> Iterator[dict]:
    """Exactly `batches` dicts {'image' float32 normalised, 'label' int32, 'mask' float32};
    examples past `limit` (> 0) are dropped, missing ones are zero images with mask 0, so
    every example counts once and all hosts run the same number of collective steps."""
    mean = np.asarray(mean, np.float32)
    std = np.asarray(std, np.float32)
    iterator = iter(examples)
    taken = 0
    for _ in range(batches):
        images, labels = [], []
        while len(images) < local_batch and (not limit or taken < limit):
            try:
                image, label = next(iterator)
            except StopIteration:
                break
            images.append(np.asarray(image, np.uint8))
            labels.append(int(label))
            taken += 1
        yield _normalised_and_padded(images, labels, local_batch, image_shape, mean, std,
                                     transform)


def _normalised_and_padded(images, labels, local_batch, image_shape, mean, std,
                           transform) -> dict:
    count = len(images)
    pixels = np.zeros((0,) + tuple(image_shape), np.float32)
    if count:
        raw = np.stack(images)
        if transform is not None:
            raw = transform(raw, np.asarray(labels))
        pixels = (raw.astype(np.float32) / 255.0 - mean) / std
    padding = local_batch - count
    return {
        "image": np.concatenate([pixels, np.zeros((padding,) + tuple(image_shape), np.float32)]),
        "label": np.asarray(labels + [0] * padding, np.int32),
        "mask": np.asarray([1.0] * count + [0.0] * padding, np.float32),
    }
