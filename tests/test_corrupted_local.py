"""corrupted_local's images are repeatable for every corruption (impulse_noise and glass_blur
included, which seed themselves from fresh entropy unless given a seed), and its memo: a second
evaluation with the same seed on the same images (every method of a study's seed) reuses them,
bit for bit what a fresh computation gives, leaving NumPy's global RNG where a fresh computation
leaves it."""

import imagecorruptions
import numpy as np
import pytest

from rspc_jax.evaluation.suites import corrupted_local


def _images(seed, count=3, size=32):
    return np.random.default_rng(seed).integers(0, 256, (count, size, size, 3), dtype=np.uint8)


def _direct(batches, name, severity, seed):
    """What imagecorruptions gives with no memo: seeded once, the batches in order."""
    np.random.seed(seed)
    out = [
        np.stack([imagecorruptions.corrupt(i, severity=severity, corruption_name=name) for i in b])
        for b in batches
    ]
    return out, np.random.get_state()


@pytest.fixture
def counted(monkeypatch):
    """Counts imagecorruptions.corrupt calls; an empty memo for each test."""
    calls = []
    real = imagecorruptions.corrupt

    def corrupt(image, **kwargs):
        calls.append(kwargs["corruption_name"])
        return real(image, **kwargs)

    monkeypatch.setattr(imagecorruptions, "corrupt", corrupt)
    monkeypatch.setattr(corrupted_local, "_MEMO", type(corrupted_local._MEMO)())
    return calls


def _states_equal(a, b):
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:]


@pytest.mark.parametrize("name", imagecorruptions.get_corruption_names("common"))
def test_every_corruption_is_repeatable_from_its_seed(monkeypatch, name):
    images = _images(0, count=2)
    passes = []
    for _ in range(2):
        monkeypatch.setattr(corrupted_local, "_MEMO", type(corrupted_local._MEMO)())
        passes.append(corrupted_local._corrupter(name, 3, 11)(images, None))
    np.testing.assert_array_equal(passes[0], passes[1])


@pytest.mark.parametrize("name", ["gaussian_noise", "zoom_blur"])
def test_a_second_pass_reuses_the_first_and_matches_imagecorruptions(counted, name):
    batches = [_images(0), _images(1)]
    expected, state_after = _direct(batches, name, 3, seed=7)
    calls_direct = len(counted)
    for _ in range(2):
        transform = corrupted_local._corrupter(name, 3, 7)
        got = [transform(b, None) for b in batches]
        for g, e in zip(got, expected):
            np.testing.assert_array_equal(g, e)
        # The global RNG ends where imagecorruptions alone leaves it, hit or miss.
        assert _states_equal(np.random.get_state(), state_after)
        # The first pass computes every image once more; the second computes none.
        assert len(counted) == 2 * calls_direct


def test_another_seed_or_other_images_are_computed_afresh(counted):
    images = _images(0)
    first = corrupted_local._corrupter("gaussian_noise", 2, 1)(images, None)
    assert len(counted) == 3
    other_seed = corrupted_local._corrupter("gaussian_noise", 2, 2)(images, None)
    assert len(counted) == 6
    assert not np.array_equal(first, other_seed)
    corrupted_local._corrupter("gaussian_noise", 2, 1)(_images(5), None)
    assert len(counted) == 9
    # A returned array is the caller's own: writing to it leaves the memo intact.
    again = corrupted_local._corrupter("gaussian_noise", 2, 1)(images, None)
    again[:] = 0
    np.testing.assert_array_equal(
        corrupted_local._corrupter("gaussian_noise", 2, 1)(images, None), first
    )
    assert len(counted) == 9


def test_the_memo_keeps_within_its_byte_budget(counted, monkeypatch):
    monkeypatch.setattr(corrupted_local, "_MEMO_BYTES", 2 * _images(0).nbytes)
    for seed in range(4):
        corrupted_local._corrupter("gaussian_noise", 1, seed)(_images(seed), None)
    assert sum(out.nbytes for out, _ in corrupted_local._MEMO.values()) <= 2 * _images(0).nbytes
    assert len(corrupted_local._MEMO) == 2  # the two newest
    corrupted_local._corrupter("gaussian_noise", 1, 3)(_images(3), None)
    assert len(counted) == 12  # the newest is still there: no new computation
