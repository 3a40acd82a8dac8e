"""The corruption model's selection statistics (evaluation/selection.py): what a collapsed
C (one mask for every image) and random selection report, in the train log and the report."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rspc_jax import rspc
from rspc_jax.evaluation import selection
from tests.conftest import smoke_config

N, K = 16, 2  # the demo's 4 x 4 patches, 2 occluded


def _random_masks(count, seed=0):
    rng = np.random.default_rng(seed)
    masks = np.zeros((count, N), np.int8)
    for row in masks:
        row[rng.choice(N, K, replace=False)] = 1
    return masks


def test_one_mask_for_every_image_reports_one_mask_zero_entropy_and_unit_iou():
    masks = np.zeros((64, N), np.int8)
    masks[:, [0, 1]] = 1
    stats = jax.device_get(selection.statistics(jnp.asarray(masks)))
    assert stats["distinct_masks"] == 1
    assert stats["entropy"] == pytest.approx(0.0, abs=1e-5)
    assert stats["mask_iou"] == pytest.approx(1.0)
    assert stats["modal_mask_share"] == pytest.approx(1.0)


def test_random_selection_reports_high_entropy_and_the_iou_of_chance():
    masks = _random_masks(512)
    stats = jax.device_get(selection.statistics(jnp.asarray(masks)))
    assert stats["distinct_masks"] == len(np.unique(masks, axis=0)) > 100
    assert stats["entropy"] > 0.98
    assert stats["modal_mask_share"] < 0.03  # 120 possible masks
    # Two random 2-of-16 masks: E[IoU] = P(1 shared) / 3 + P(2 shared) = 0.2333 / 3 + 0.0083.
    assert stats["mask_iou"] == pytest.approx(0.2333 / 3 + 1 / 120, abs=0.01)


def test_mask_iou_traces_for_batches_whose_pair_count_passes_int32():
    """The memory planner compiles steps at tens of thousands of images per device: 50,000
    images make 2.5e9 ordered pairs, more than an int32 holds (traced only, not computed)."""
    iou = jax.eval_shape(selection.mask_iou, jax.ShapeDtypeStruct((50_000, N), jnp.int8))
    assert iou.shape == () and iou.dtype == jnp.float32


def test_on_object_counts_the_selected_patches_that_hold_a_stroke():
    pixels = np.zeros((2, 8, 8, 3), np.float32)
    pixels[:, :4, :4] = 1.0  # the object fills patch 0 of a 2 x 2 grid of 4-px patches
    on_object = rspc.object_patches(jnp.asarray(pixels), 4, threshold=0.1)
    np.testing.assert_array_equal(on_object, [[True, False, False, False]] * 2)
    masks = jnp.asarray([[1, 1, 0, 0], [0, 1, 1, 0]])
    assert float(selection.statistics(masks, on_object)["on_object"]) == pytest.approx(0.25)


def test_the_train_log_and_the_report_carry_the_statistics(demo_run, digits_data_dir, tmp_path):
    from rspc_jax.evaluation import run_suites

    workdir, _ = demo_run
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/loss" in r]
    for key in ("distinct_masks", "entropy", "mask_iou", "on_object"):
        assert all(f"train/selection_{key}" in r for r in train), key
    ratio = train[-1]["train/weighted_align_to_ce"]
    assert ratio == pytest.approx(0.005 * train[-1]["train/align"] / train[-1]["train/ce"], 0.3)
    config = smoke_config(digits_data_dir, **{"evaluation.occlusion_masks": 2})
    results = run_suites.run_suites(
        config, workdir=str(workdir), suites="patch_occlusion", out=str(tmp_path)
    )
    chosen = results["patch_occlusion"]["selection"]
    assert 1 <= chosen["distinct_masks"] <= 297
    assert 0 <= chosen["entropy"] <= 1 and 0 <= chosen["on_object"] <= 1
    assert 0 <= chosen["blank_mask_iou"] <= 1
    assert sum(chosen["position_frequency"]) == pytest.approx(2.0)  # 2 of 16 per image
    report = (tmp_path / "report.md").read_text()
    assert "C: distinct masks" in report and "C: selected patches on the object" in report
    assert "C: mask IoU with its mask of a blank image" in report
