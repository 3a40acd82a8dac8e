"""Benchmark metric definitions (docs/evaluation.md, "ImageNet-C" to "CIFAR-10-C and CIFAR-100-C", "200-class lists")."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import rankdata

from rspc_jax.evaluation import protocols as P

# ---------------------------------------------------------------------------------------------
# ImageNet-C

# Per-severity AlexNet errors of docs/evaluation.md, "ImageNet-C: AlexNet normalisers", typed independently of the module's constants.
ALEXNET_PER_SEVERITY = {
    "gaussian_noise": (0.69528, 0.82542, 0.93554, 0.98138, 0.99452),
    "shot_noise": (0.71224, 0.85108, 0.93574, 0.98182, 0.99146),
    "impulse_noise": (0.78374, 0.89808, 0.94870, 0.98720, 0.99548),
    "defocus_blur": (0.65624, 0.73202, 0.85036, 0.91364, 0.94714),
    "glass_blur": (0.64308, 0.75054, 0.88806, 0.91622, 0.93344),
    "motion_blur": (0.58430, 0.70048, 0.82108, 0.89750, 0.92638),
    "zoom_blur": (0.70008, 0.76992, 0.80784, 0.84198, 0.87198),
    "snow": (0.71726, 0.88392, 0.86468, 0.91870, 0.94952),
    "frost": (0.61390, 0.79734, 0.88790, 0.89942, 0.93430),
    "fog": (0.67474, 0.76050, 0.84378, 0.87260, 0.94500),
    "brightness": (0.45140, 0.48502, 0.54048, 0.62166, 0.72440),
    "contrast": (0.64548, 0.76150, 0.88874, 0.97760, 0.99270),
    "elastic_transform": (0.52596, 0.70116, 0.55686, 0.64076, 0.80554),
    "pixelate": (0.52218, 0.54620, 0.73728, 0.87092, 0.91262),
    "jpeg_compression": (0.51002, 0.54718, 0.57294, 0.65458, 0.74778),
}
SEVERITY_OFFSETS = (-0.02, -0.01, 0.0, 0.01, 0.02)  # sum to 0: the severity mean is the base


def test_corruption_lists_and_alexnet_constants():
    assert P.IMAGENET_C_CORRUPTIONS == tuple(ALEXNET_PER_SEVERITY)
    assert P.NOISE_CORRUPTIONS == ("gaussian_noise", "shot_noise", "impulse_noise")
    assert P.IMAGENET_C_EXTRA == ("speckle_noise", "gaussian_blur", "spatter", "saturate")
    for corruption, per_severity in ALEXNET_PER_SEVERITY.items():
        assert P.ALEXNET_ERR[corruption] == pytest.approx(np.mean(per_severity), abs=1e-6)
    non_noise = [P.ALEXNET_ERR[c] for c in P.IMAGENET_C_CORRUPTIONS[3:]]
    assert np.mean(list(P.ALEXNET_ERR.values())) == pytest.approx(0.78899, abs=1e-5)
    assert np.mean(non_noise) == pytest.approx(0.76095, abs=1e-5)


def table_with_ce(ce_of: dict[str, float], extra_accuracy: float | None = None) -> dict:
    """Accuracy table whose corruption c has CE_c = ce_of[c] (x100), varying over severities."""
    table = {}
    for corruption, ce in ce_of.items():
        base = 1.0 - P.ALEXNET_ERR[corruption] * ce / 100.0
        for severity, offset in zip(P.SEVERITIES, SEVERITY_OFFSETS):
            table[corruption, severity] = base + offset
    if extra_accuracy is not None:
        table.update({(c, s): extra_accuracy for c in P.IMAGENET_C_EXTRA for s in P.SEVERITIES})
    return table


def test_alexnet_accuracies_give_mce_100():
    summary = P.imagenet_c_summary(table_with_ce({c: 100.0 for c in P.IMAGENET_C_CORRUPTIONS}))
    assert summary["mce"] == pytest.approx(100.0, abs=1e-9)
    assert summary["mce_no_noise"] == pytest.approx(100.0, abs=1e-9)
    assert summary["mean_accuracy"] == pytest.approx(1 - 0.78899, abs=1e-5)
    assert summary["mean_accuracy_no_noise"] == pytest.approx(1 - 0.76095, abs=1e-5)
    assert summary["missing"] == []
    assert summary["mean_accuracy_19"] is None  # the 4 extras were not given


def test_mce_with_differing_corruptions():
    # noise CE 80, fog CE 110, the other 11 CE 50:
    # mCE = (3*80 + 110 + 11*50) / 15 = 60, w/o noise = (110 + 11*50) / 12 = 55.
    ce_of = {c: 50.0 for c in P.IMAGENET_C_CORRUPTIONS}
    ce_of.update({"gaussian_noise": 80.0, "shot_noise": 80.0, "impulse_noise": 80.0, "fog": 110.0})
    summary = P.imagenet_c_summary(table_with_ce(ce_of, extra_accuracy=0.3))
    assert summary["mce"] == pytest.approx(60.0, abs=1e-9)
    assert summary["mce_no_noise"] == pytest.approx(55.0, abs=1e-9)
    assert summary["per_corruption"]["fog"]["ce"] == pytest.approx(110.0, abs=1e-9)
    assert summary["per_corruption"]["fog"]["accuracy"] == pytest.approx(1 - 1.1 * 0.819324)
    # Mean accuracy = 1 - mean of CE_c/100 * E_c over the corruptions.
    noise_err = 0.8 * (0.886428 + 0.894468 + 0.922640)
    fog_err = 1.1 * 0.819324
    rest_err = 0.5 * (12 * 0.76095 - 0.819324)
    assert summary["mean_accuracy"] == pytest.approx(
        1 - (noise_err + fog_err + rest_err) / 15, abs=1e-5
    )
    assert summary["mean_accuracy_no_noise"] == pytest.approx(
        1 - (fog_err + rest_err) / 12, abs=1e-5
    )
    assert summary["mean_accuracy_19"] == pytest.approx(
        (15 * summary["mean_accuracy"] + 4 * 0.3) / 19
    )
    assert summary["per_corruption"]["saturate"] == {"accuracy": pytest.approx(0.3)}
    json.dumps(summary)


def test_missing_entries_give_none_and_are_listed():
    table = table_with_ce({c: 50.0 for c in P.IMAGENET_C_CORRUPTIONS})
    del table["fog", 3]
    summary = P.imagenet_c_summary(table)
    for key in ("mce", "mce_no_noise", "mean_accuracy", "mean_accuracy_no_noise"):
        assert summary[key] is None, key
    assert summary["per_corruption"]["fog"] == {"accuracy": None, "ce": None}
    assert summary["missing"] == [["fog", 3]]

    table = table_with_ce({c: 50.0 for c in P.IMAGENET_C_CORRUPTIONS[1:]})  # no gaussian_noise
    summary = P.imagenet_c_summary(table)
    assert summary["mce"] is None and summary["mean_accuracy"] is None
    assert summary["mce_no_noise"] == pytest.approx(50.0)  # needs only the 12 non-noise
    assert summary["missing"] == [["gaussian_noise", s] for s in P.SEVERITIES]


def test_imagenet_c_summary_rejects_percentages_and_unknown_names():
    with pytest.raises(ValueError, match="fraction"):
        P.imagenet_c_summary({("fog", 1): 55.0})
    with pytest.raises(ValueError, match="unknown"):
        P.imagenet_c_summary({("elastic", 1): 0.5})
    with pytest.raises(ValueError, match="unknown"):
        P.imagenet_c_summary({("fog", 6): 0.5})


# ---------------------------------------------------------------------------------------------
# ImageNet-A / -R


@pytest.mark.parametrize(
    "indices, wnids",
    [(P.IMAGENET_A_INDICES, P.IMAGENET_A_WNIDS), (P.IMAGENET_R_INDICES, P.IMAGENET_R_WNIDS)],
)
def test_subset_lists(indices, wnids):
    assert indices.dtype == np.int32 and indices.shape == (200,)
    assert np.all(np.diff(indices) > 0) and 0 <= indices[0] and indices[-1] < 1000
    assert len(wnids) == 200 and list(wnids) == sorted(set(wnids))
    assert all(len(w) == 9 and w.startswith("n") for w in wnids)


def test_subsets_agree_on_shared_classes():
    a = dict(zip(P.IMAGENET_A_INDICES.tolist(), P.IMAGENET_A_WNIDS))
    r = dict(zip(P.IMAGENET_R_INDICES.tolist(), P.IMAGENET_R_WNIDS))
    shared = set(a) & set(r)
    assert len(shared) == 86
    assert all(a[i] == r[i] for i in shared)
    assert len(set(P.IMAGENET_A_WNIDS) & set(P.IMAGENET_R_WNIDS)) == 86
    assert a[6] == "n01498041" and r[1] == "n01443537"  # stingray, goldfish


def test_restricted_prediction_picks_best_class_inside_subset():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 1000)).astype(np.float32)
    outside = 0  # not in ImageNet-A (it starts at 6)
    assert outside not in P.IMAGENET_A_INDICES
    inside = [P.IMAGENET_A_INDICES[5], P.IMAGENET_A_INDICES[150], P.IMAGENET_A_INDICES[-1]]
    logits[:, outside] = 100.0
    logits[[0, 1, 2], inside] = 50.0
    expected = np.array(inside)
    prediction = P.restricted_prediction(logits, P.IMAGENET_A_INDICES)
    np.testing.assert_array_equal(prediction, expected)
    np.testing.assert_array_equal(
        P.restricted_prediction(jnp.asarray(logits), P.IMAGENET_A_INDICES), expected
    )
    jitted = jax.jit(lambda x: P.restricted_prediction(x, P.IMAGENET_A_INDICES))
    np.testing.assert_array_equal(jitted(jnp.asarray(logits)), expected)
    assert P.restricted_prediction(logits[1], P.IMAGENET_A_INDICES) == inside[1]


# ---------------------------------------------------------------------------------------------
# ImageNet-P: loop implementations of the definitions of docs/evaluation.md, "ImageNet-P: flip probability and top-5 distance".


def compared_pairs(num_frames: int, noise: bool, difficulty: int) -> list[tuple[int, int]]:
    """Noise: (first frame, frame j); else consecutive elements of each interleaved sub-sequence."""
    step = 1 if noise else difficulty
    pairs = []
    for start in range(step):
        subsequence = list(range(start, num_frames, step))
        for previous, current in zip(subsequence, subsequence[1:]):
            pairs.append((subsequence[0] if noise else previous, current))
    return pairs


def loop_flip_probability(predictions, noise, difficulty):
    per_video = []
    for video in predictions:
        pairs = compared_pairs(len(video), noise, difficulty)
        per_video.append(np.mean([video[a] != video[b] for a, b in pairs]))
    return np.mean(per_video)


def loop_top5_distance(logits, noise, difficulty):
    per_video = []
    for video in logits:
        ranks = [rankdata(-frame, method="ordinal") for frame in video]
        distances = []
        for a, b in compared_pairs(len(video), noise, difficulty):
            class_at_rank = np.argsort(ranks[a])  # class_at_rank[k-1] = class ranked k in frame a
            distance = 0
            for k in range(1, 6):
                sigma_k = ranks[b][class_at_rank[k - 1]]
                distance += abs(k - min(sigma_k, 6))
            distances.append(distance)
        per_video.append(np.mean(distances))
    return np.mean(per_video)


def test_flip_probability_small_hand_example():
    predictions = np.array([[0, 0, 1, 1]])
    assert P.flip_probability(predictions, noise=False) == pytest.approx(1 / 3)
    assert P.flip_probability(predictions, noise=True) == pytest.approx(2 / 3)
    assert P.flip_probability(predictions, noise=False, difficulty=2) == pytest.approx(1.0)
    # Mean over videos of the per-video rates: (0 + 1) / 2.
    two_videos = np.array([[0, 0, 0, 0], [0, 1, 0, 1]])
    assert P.flip_probability(two_videos, noise=False) == pytest.approx(0.5)
    np.testing.assert_allclose(P.per_video_flip_rates(two_videos, noise=False), [0.0, 1.0])


def test_top5_distance_small_hand_example():
    first = np.arange(7, 0, -1, dtype=np.float32)  # class k-1 ranked k
    swapped = first[[1, 0, 2, 3, 4, 5, 6]]  # classes 0 and 1 swap ranks: distance 1 + 1
    dropped = np.array([0, 7, 6, 5, 4, 3, 2], np.float32)  # class 0 to rank 7: 5 + 4 * 1
    assert P.top5_distance(np.stack([first, swapped])[None], noise=True) == pytest.approx(2)
    assert P.top5_distance(np.stack([first, dropped])[None], noise=True) == pytest.approx(9)
    videos = np.stack([np.stack([first, swapped, dropped]), np.stack([first, first, first])])
    np.testing.assert_allclose(P.per_video_top5_distances(videos, noise=True), [5.5, 0.0])


@pytest.mark.parametrize(
    "noise, difficulty", [(True, 1), (True, 2), (False, 1), (False, 2), (False, 3)]
)
def test_flip_probability_matches_loop_definition(noise, difficulty):
    predictions = np.random.default_rng(difficulty).integers(0, 3, size=(7, 11))
    assert P.flip_probability(predictions, noise=noise, difficulty=difficulty) == pytest.approx(
        loop_flip_probability(predictions, noise, difficulty), abs=1e-12
    )


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("noise, difficulty", [(True, 1), (True, 2), (False, 1), (False, 2)])
def test_top5_distance_matches_loop_definition(noise, difficulty, tied):
    rng = np.random.default_rng(10 * difficulty + noise)
    if tied:  # few distinct values: ties everywhere, broken by class index
        logits = rng.integers(0, 4, size=(6, 9, 12)).astype(np.float32)
    else:
        logits = rng.normal(size=(6, 9, 12)).astype(np.float32)
    assert P.top5_distance(logits, noise=noise, difficulty=difficulty) == pytest.approx(
        loop_top5_distance(logits, noise, difficulty), abs=1e-12
    )


def test_frame_pairs_need_enough_frames():
    with pytest.raises(ValueError, match="no pair"):
        P.flip_probability(np.zeros((2, 2), int), noise=False, difficulty=2)
    with pytest.raises(ValueError, match="difficulty"):
        P.flip_probability(np.zeros((2, 5), int), noise=False, difficulty=0)


def test_normalized_rate():
    alexnet = {p: 0.1 * (i + 1) for i, p in enumerate(P.IMAGENET_P_PERTURBATIONS)}
    values = {p: 0.5 * v for p, v in alexnet.items()}
    values["rotate"] = alexnet["rotate"] * 1.4  # ratio 140 instead of 50
    rates = P.normalized_rate(values, alexnet)
    assert rates["per_perturbation"]["rotate"] == pytest.approx(140.0)
    assert rates["per_perturbation"]["snow"] == pytest.approx(50.0)
    assert rates["mean"] == pytest.approx((9 * 50 + 140) / 10)
    assert rates["missing"] == []
    del values["tilt"]
    rates = P.normalized_rate(values, alexnet)
    assert rates["mean"] is None and rates["missing"] == ["tilt"]


# ---------------------------------------------------------------------------------------------
# CIFAR-C


def test_cifar_c_summary():
    assert len(P.CIFAR_C_CORRUPTIONS) == 15
    assert "glass_blur" in P.CIFAR_C_CORRUPTIONS and "elastic_transform" in P.CIFAR_C_CORRUPTIONS
    assert P.CIFAR_C_EXTRA == ("speckle_noise", "gaussian_blur", "spatter", "saturate")
    accuracy = {c: 0.8 for c in P.CIFAR_C_CORRUPTIONS}
    accuracy["fog"] = 0.5
    summary = P.cifar_c_summary(accuracy)
    assert summary["mean_accuracy"] == pytest.approx((14 * 0.8 + 0.5) / 15)
    assert summary["mean_accuracy_19"] is None
    accuracy.update({c: 0.1 for c in P.CIFAR_C_EXTRA})
    summary = P.cifar_c_summary(accuracy)
    assert summary["mean_accuracy_19"] == pytest.approx((14 * 0.8 + 0.5 + 4 * 0.1) / 19)
    assert summary["per_corruption"]["fog"] == 0.5
    del accuracy["pixelate"]
    summary = P.cifar_c_summary(accuracy)
    assert summary["mean_accuracy"] is None and summary["mean_accuracy_19"] is None
    assert summary["missing"] == ["pixelate"]
    with pytest.raises(ValueError, match="unknown"):
        P.cifar_c_summary({"elastic": 0.5})
