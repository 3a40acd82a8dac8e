"""Random patches on the object (`rspc.selection='random_object'`, the `random_object_patches`
ablation; docs/method.md, "Random patches on the object"): the control that puts the occluded
patches where the content C puts them (on the object) without choosing them against the model.
Its masks hold only object patches while an image has enough of them, are random among them,
need a dataset that says where its object is, and train through the normal step."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rspc_jax import ConfigError, rspc
from tests.conftest import smoke_config

N, K = 16, 2  # 4 x 4 patches, rho 0.1


def _draws(seed, count):
    return jax.random.uniform(jax.random.PRNGKey(seed), (count, N))


def test_masks_fall_on_the_object_and_are_random_among_its_patches():
    on_object = np.zeros((64, N), bool)
    on_object[:, [0, 1, 4, 5, 6]] = True  # five object patches, the same for every image
    keep = rspc.keep_mask(rspc.preferred_first_scores(_draws(0, 64), jnp.asarray(on_object)), 0.1)
    occluded = np.asarray(keep) == 0
    assert (occluded.sum(axis=1) == K).all()
    assert not (occluded & ~on_object).any()  # never a background patch
    # random among the five: every object patch is chosen for some image
    assert occluded[:, [0, 1, 4, 5, 6]].all(axis=1).sum() == 0
    assert (occluded.sum(axis=0)[[0, 1, 4, 5, 6]] > 0).all()


def test_an_image_with_fewer_object_patches_than_the_count_loses_them_all_and_random_others():
    on_object = np.zeros((32, N), bool)
    on_object[:, 9] = True  # one object patch, two occluded
    keep = rspc.keep_mask(rspc.preferred_first_scores(_draws(1, 32), jnp.asarray(on_object)), 0.1)
    occluded = np.asarray(keep) == 0
    assert (occluded.sum(axis=1) == K).all() and occluded[:, 9].all()
    assert len({tuple(np.flatnonzero(row)) for row in occluded}) > 5  # the other one at random


def test_a_dataset_that_does_not_say_where_its_object_is_is_refused_before_anything_builds():
    from rspc_jax.training import setup

    config = smoke_config("")
    config.rspc.selection = "random_object"
    config.dataset = "cifar10"
    with pytest.raises(ConfigError, match="object"):
        setup.validate_config(config)
    config.dataset = "sklearn_digits_canvas"
    setup.validate_config(config)  # the digits say which pixels are strokes


def test_only_the_switch_changes_the_selection():
    from rspc_jax.data import specs
    from rspc_jax.training import setup

    config = smoke_config("")
    spec = specs.dataset_spec("sklearn_digits_canvas")
    assert setup.step_settings(config, spec).rspc.selection == "learned"
    config.rspc.selection = "random_object"
    switched = setup.step_settings(config, spec).rspc
    assert switched.selection == "random_object"
    assert switched.temperature is None and not switched.mixed_masks  # nothing of C's


def test_train_step_occludes_only_digit_patches_on_the_canvas(digits_data_dir, tmp_path):
    """On the canvas every digit covers at least 2 x 2 patches of 8 px, so every occluded
    patch of every logged batch holds a stroke, and the masks differ between images."""
    from rspc_jax.training import ablations, loop

    config = smoke_config(digits_data_dir)
    config.dataset = "sklearn_digits_canvas"
    ablations.ABLATIONS["random_object_patches"][1](config)
    config.rspc.lam = 0.5
    config.evaluation.suites = "clean"
    workdir = str(tmp_path / "run")
    loop.train_and_evaluate(config, workdir)
    rows = [json.loads(line) for line in open(f"{workdir}/metrics.jsonl")]
    logged = [r for r in rows if "train/selection_on_object" in r]
    assert logged and all(r["train/occluded_fraction"] == pytest.approx(K / N) for r in logged)
    assert all(r["train/selection_on_object"] == 1.0 for r in logged)
    assert all(r["train/selection_distinct_masks"] > 10 for r in logged)
