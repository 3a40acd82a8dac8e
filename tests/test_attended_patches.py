"""Occluding what the classifier attends to (`rspc.selection='attended'`, 'random_attended';
docs/method.md, "Occluding what the classifier attends to"): the k most attended patches of
a known attention map, k at random among the m most attended, ties broken at random, each
family's attention read from what it sows, a family without one refused, no corruption model
built, and a run with each selection that trains, evaluates and exports."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rspc_jax import ConfigError, models, rspc
from tests.conftest import smoke_config

N, K = 16, 2  # 4 x 4 patches, rho 0.1


def _draws(seed, shape):
    return jax.random.uniform(jax.random.PRNGKey(seed), shape)


def _ties(seed, count):
    return jax.random.gumbel(jax.random.PRNGKey(seed), (count, N))


def _occluded(attention, m, seed):
    scores = rspc.most_attended_first(
        attention, m, _ties(seed, len(attention)), _draws(seed + 1, (len(attention), N))
    )
    return np.asarray(rspc.keep_mask(scores, 0.1)) == 0


def test_attended_occludes_the_k_patches_of_a_known_attention_map_ranked_highest():
    attention = _draws(0, (32, N))  # distinct values: one top k per image
    occluded = _occluded(attention, K, seed=1)
    top_k = np.argsort(-np.asarray(attention), axis=1)[:, :K]
    expected = np.zeros_like(occluded)
    np.put_along_axis(expected, top_k, True, axis=1)
    np.testing.assert_array_equal(occluded, expected)


def test_random_attended_draws_k_at_random_among_the_m_most_attended_only():
    attention = jnp.broadcast_to(jnp.arange(N, dtype=jnp.float32), (256, N))  # 15 ranks first
    occluded = _occluded(attention, 6, seed=2)
    assert (occluded.sum(axis=1) == K).all()
    assert not occluded[:, : N - 6].any()  # never outside the 6 most attended
    assert (occluded[:, N - 6 :].sum(axis=0) > 0).all()  # each of the 6 is drawn for some image
    assert not np.array_equal(occluded, _occluded(attention, 6, seed=3))  # the draws decide


def test_tied_attention_is_broken_by_the_draws_not_by_position():
    attention = jnp.zeros((64, N)).at[:, [5, 6, 9, 10]].set(1.0)  # four tied top patches
    occluded = _occluded(attention, K, seed=4)
    assert not occluded[:, [0, 1, 2, 3, 4, 7, 8, 11, 12, 13, 14, 15]].any()
    assert (occluded[:, [5, 6, 9, 10]].sum(axis=0) > 0).all()


def test_a_coarser_token_grid_covers_its_patches_and_one_that_does_not_tile_is_refused():
    per_token = jnp.arange(4.0)[None]  # 2 x 2 tokens over 4 x 4 patches (RVT's pooled stage)
    on_patches = np.asarray(rspc._on_patch_grid(per_token, (4, 4))).reshape(4, 4)
    np.testing.assert_array_equal(
        on_patches, [[0, 0, 1, 1], [0, 0, 1, 1], [2, 2, 3, 3], [2, 2, 3, 3]]
    )
    np.testing.assert_array_equal(
        rspc._on_patch_grid(jnp.arange(16.0)[None], (4, 4))[0], np.arange(16.0)
    )
    with pytest.raises(ValueError, match="rspc.patch_size"):
        rspc._on_patch_grid(jnp.ones((1, 9)), (4, 4))


def _batch(model_name, image_size, **overrides):
    model = models.create(model_name, num_classes=10, **overrides)
    images = _draws(5, (3, image_size, image_size, 3))
    variables = model.init(jax.random.PRNGKey(6), images, train=False)
    return rspc.SelectionBatch(
        images=images,
        example_ids=jnp.arange(3),
        rng=jax.random.PRNGKey(7),
        step=jnp.zeros((), jnp.int32),
        patch_size=model.patch_size,
        model=model,
        params=variables["params"],
        batch_stats=variables.get("batch_stats", {}),
    )


@pytest.mark.parametrize(
    "model_name,image_size,overrides,received",
    [
        # pool='avg', RVT: the attention each token receives, whose sum over tokens is 1;
        # RVT's last stage is 2 x 2 tokens over the 4 x 4 patches, each repeated 4 times
        ("vit_demo", 32, {}, 1.0),
        ("rvt_tiny", 64, dict(base_dims=(8, 8), depth=(1, 1), heads=(1, 2)), 4.0),
        # the class token's row (the last block's or the last class-attention block's)
        ("vit_tiny", 16, dict(width=32, depth=1, num_heads=2), None),
        ("cait_xxs24_224", 32, dict(embed_dim=32, depth=1, num_heads=2, patch_size=8), None),
        ("xcit_nano_12_p8_224", 32, dict(embed_dim=32, depth=1, num_heads=2), None),
        ("fan_tiny_12_p16_224", 64, dict(embed_dim=32, depth=1, num_heads=2), None),
    ],
)
def test_each_family_gives_one_attention_per_patch_without_a_gradient(
    model_name, image_size, overrides, received
):
    batch = _batch(model_name, image_size, **overrides)
    attention = rspc.clean_attention(batch)
    assert attention.shape == (3, batch.num_patches)
    totals = np.asarray(attention.sum(axis=1))
    if received is None:  # a distribution over the class token and the patches
        assert ((totals > 0) & (totals < 1)).all()
    else:  # each query's row sums to 1, so the mean column sums do
        np.testing.assert_allclose(totals, received, rtol=1e-5)

    def total(params):
        return rspc.clean_attention(
            rspc.SelectionBatch(**{**batch.__dict__, "params": params})
        ).sum()

    grads = jax.grad(total)(batch.params)
    assert all(not np.asarray(g).any() for g in jax.tree.leaves(grads))


def test_a_model_without_attention_over_the_image_is_refused_with_the_fix():
    config = smoke_config("")
    config.rspc.selection = "random_attended"
    swin = models.create("swin_tiny_patch4_window7_224", num_classes=10)
    with pytest.raises(ConfigError, match="window") as refused:
        rspc.check_model(config.rspc, swin, "swin_tiny_patch4_window7_224")
    assert "ViT/DeiT" in str(refused.value) and "rspc.selection='random'" in str(refused.value)
    config.rspc.patch_size = 4  # the attention ranks tokens, not other patches
    with pytest.raises(ConfigError, match="leave rspc.patch_size at 0"):
        rspc.check_model(config.rspc, models.create("vit_demo", num_classes=10), "vit_demo")


def test_no_corruption_model_is_built_for_the_attention_selections():
    config = smoke_config("")
    model = models.create("vit_demo", num_classes=10)
    for selection in ("attended", "random_attended"):
        config.rspc.selection = selection
        assert rspc.corruption_model_for(config.rspc, model) is None
    config.rspc.selection = "random"  # the random selections keep their (untrained) C
    assert rspc.corruption_model_for(config.rspc, model) is not None


@pytest.mark.parametrize("selection", ["attended", "random_attended"])
def test_a_run_trains_evaluates_and_exports_without_a_corruption_model(
    digits_data_dir, tmp_path, selection
):
    from rspc_jax.evaluation import run_suites
    from rspc_jax.interop import export
    from rspc_jax.training import loop

    config = smoke_config(digits_data_dir, dataset="sklearn_digits_canvas")
    config.rspc.selection, config.rspc.lam = selection, 0.5
    config.evaluation.suites = "clean,patch_occlusion"
    workdir = str(tmp_path / selection)
    loop.train_and_evaluate(config, workdir)
    rows = [json.loads(line) for line in open(f"{workdir}/metrics.jsonl")]
    logged = [r for r in rows if "train/selection_on_object" in r]
    assert logged and all(r["train/occluded_fraction"] == pytest.approx(K / N) for r in logged)
    assert all(np.isfinite(r["train/loss"]) for r in logged)
    results = run_suites.run_suites(config, workdir=workdir, suites="clean,patch_occlusion")
    occlusion = results["patch_occlusion"]
    assert 0 <= occlusion["random_mask_accuracy"]["mean"] <= 1
    assert "learned_mask_accuracy" not in occlusion and "selection" not in occlusion  # no C
    summary = export.export(workdir, str(tmp_path / "vit.safetensors"))
    assert "Exported vit_demo" in summary
    with pytest.raises(ConfigError, match=f"rspc.selection='{selection}'"):
        export.export(
            workdir, str(tmp_path / "v.safetensors"), corruption_out=str(tmp_path / "c.safetensors")
        )
