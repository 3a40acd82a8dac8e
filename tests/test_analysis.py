"""`python -m rspc_jax.analyze`: the similarity measures, lesions and attention masks as
interventions on the model call (checked against edits by hand), and the four analyses on
the demo checkpoint (consistent with each other and monotone where they must be)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rspc_jax import models
from rspc_jax.evaluation import run_suites as driver
from rspc_jax.evaluation.analysis import attention_masks, similarity
from rspc_jax.models import interventions
from tests.conftest import REPO, run_python, smoke_config

IMAGES = jax.random.normal(jax.random.PRNGKey(1), (3, 32, 32, 3))


# --------------------------------------------------------------------------------------
# similarity


def test_a_layer_correlates_with_itself_and_sizes_must_match():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(6, 20)), rng.normal(size=(6, 12))
    sums = np.asarray(similarity.pearson_sums([a, a, b], jnp.ones(6)))
    np.testing.assert_allclose(sums[0, 1] / 6, 1.0, rtol=1e-6)
    np.testing.assert_allclose(np.diag(sums) / 6, 1.0, rtol=1e-6)
    assert np.isnan(sums[0, 2]) and np.isnan(sums[2, 1])
    expected = np.mean([np.corrcoef(a[i], -2 * a[i] + 1)[0, 1] for i in range(6)])
    assert similarity.pearson_sums([a, -2 * a + 1], jnp.ones(6))[0, 1] / 6 == pytest.approx(
        expected
    )


def test_cka_is_one_on_the_diagonal_and_invariant_to_orthogonal_transforms():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 10)).astype(np.float32)
    y = np.tanh(x @ rng.normal(size=(10, 7))).astype(np.float32)
    q, _ = np.linalg.qr(rng.normal(size=(10, 10)))
    hsic = np.asarray(similarity.hsic_sums([x, y, (3 * x @ q).astype(np.float32)], jnp.ones(16)))
    cka = similarity.cka_from_hsic(hsic)
    np.testing.assert_allclose(np.diag(cka), 1.0, rtol=1e-5)
    np.testing.assert_allclose(cka[0, 2], 1.0, rtol=1e-4)
    np.testing.assert_allclose(cka[1, 2], cka[1, 0], rtol=1e-4)
    assert 0.0 < cka[0, 1] < 1.0


def test_padded_examples_do_not_change_the_hsic():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 5)), rng.normal(size=(8, 3))
    padded = [np.concatenate([f, rng.normal(size=(4, f.shape[1]))]) for f in (x, y)]
    mask = jnp.asarray([1.0] * 8 + [0.0] * 4)
    np.testing.assert_allclose(
        similarity.hsic_sums(padded, mask),
        similarity.hsic_sums([x, y], jnp.ones(8)),
        rtol=1e-4,
        atol=1e-6,
    )


# --------------------------------------------------------------------------------------
# interventions: lesions


def _model_and_variables(name, **overrides):
    model = models.create(name, num_classes=10, **overrides)
    return model, model.init(jax.random.PRNGKey(0), IMAGES, train=False)


@pytest.fixture(scope="module")
def vit():  # with a class token, so the masks have a prefix
    return _model_and_variables("vit_demo", width=32, depth=2, num_heads=2, pool="token")


def _zeroed(variables, paths):
    """Parameters under block paths[i][0] whose later keys contain paths[i][1:], zeroed."""

    def matches(keys, path):
        return keys[0] == path[0] and all(any(p in k for k in keys[1:]) for p in path[1:])

    params = jax.tree_util.tree_map_with_path(
        lambda path, v: (
            jnp.zeros_like(v) if any(matches([k.key for k in path], p) for p in paths) else v
        ),
        variables["params"],
    )
    return {**variables, "params": params}


def test_keeping_everything_is_the_model_itself(vit):
    model, variables = vit
    keep = interventions.keep_all(2)
    np.testing.assert_array_equal(
        interventions.apply(
            model, variables, IMAGES, interventions.Intervention(keep=keep), train=False
        ),
        model.apply(variables, IMAGES, train=False),
    )


@pytest.mark.parametrize(
    "branches,zeroed",
    [
        (("attn", "mlp"), [("blocks_1", "attn", "proj"), ("blocks_1", "mlp", "fc2")]),
        (("attn",), [("blocks_1", "attn", "proj")]),
        (("mlp",), [("blocks_1", "mlp", "fc2")]),
    ],
)
def test_a_lesion_equals_zeroing_the_branch_output_by_hand(vit, branches, zeroed):
    model, variables = vit
    keep = interventions.keep_all(2)
    for branch in branches:
        keep[1, interventions.BRANCHES.index(branch)] = 0.0
    lesioned = interventions.apply(
        model, variables, IMAGES, interventions.Intervention(keep=keep), train=False
    )
    by_hand = model.apply(_zeroed(variables, zeroed), IMAGES, train=False)
    np.testing.assert_allclose(lesioned, by_hand, atol=1e-5)
    assert not np.allclose(lesioned, model.apply(variables, IMAGES, train=False), atol=1e-3)


def test_an_xcit_block_lesion_removes_attention_lpi_and_mlp():
    model, variables = _model_and_variables(
        "xcit_nano_12_p16_224", embed_dim=16, depth=2, num_heads=2, cls_attn_layers=1
    )
    keep = interventions.keep_all(2)
    keep[0] = 0.0
    lesioned = interventions.apply(
        model, variables, IMAGES, interventions.Intervention(keep=keep), train=False
    )
    by_hand = model.apply(_zeroed(variables, [("blocks_0", "gamma")]), IMAGES, train=False)
    np.testing.assert_allclose(lesioned, by_hand, atol=1e-5)
    with pytest.raises(ValueError, match="between channels"):
        bias = attention_masks.bias(np.ones((4, 4), bool))
        interventions.apply(
            model,
            variables,
            IMAGES,
            interventions.Intervention(attention_bias=(bias, bias)),
            train=False,
        )


@pytest.mark.parametrize(
    "name,overrides,zeroed",
    [
        (
            "swin_tiny_patch4_window7_224",
            dict(embed_dim=16, depths=(2, 1), num_heads=(2, 2), window_size=4),
            [("layers_0", "blocks_0", "attn", "proj"), ("layers_0", "blocks_0", "mlp", "fc2")],
        ),
        (
            "cait_xxs24_224",
            dict(embed_dim=16, depth=2, num_heads=2, init_values=0.5),
            [("blocks_0", "gamma_1"), ("blocks_0", "gamma_2")],
        ),
    ],
)
def test_swin_and_cait_blocks_can_be_lesioned(name, overrides, zeroed):
    model, variables = _model_and_variables(name, **overrides)
    keep = interventions.keep_all(3 if name.startswith("swin") else 2)
    keep[0] = 0.0
    lesioned = interventions.apply(
        model, variables, IMAGES, interventions.Intervention(keep=keep), train=False
    )
    by_hand = model.apply(_zeroed(variables, zeroed), IMAGES, train=False)
    error = np.max(np.abs(lesioned - by_hand))
    effect = np.max(np.abs(lesioned - model.apply(variables, IMAGES, train=False)))
    assert error < 1e-6 and effect > 100 * max(error, 1e-8), (error, effect)


# --------------------------------------------------------------------------------------
# interventions: restricted attention


def _attention(model, variables, allowed):
    intervention = interventions.Intervention(attention_bias=(attention_masks.bias(allowed),) * 2)
    logits, state = interventions.apply(
        model,
        variables,
        IMAGES,
        intervention,
        train=False,
        sow_attention=True,
        mutable=["intermediates"],
    )
    return logits, state["intermediates"]["attention_maps"]


def test_a_radius_covering_the_grid_is_unrestricted_attention(vit):
    model, variables = vit
    logits, _ = _attention(model, variables, attention_masks.local(4, 1, radius=3))
    np.testing.assert_array_equal(logits, model.apply(variables, IMAGES, train=False))


def test_radius_zero_lets_a_patch_see_only_itself_and_the_class_token(vit):
    model, variables = vit
    logits, maps = _attention(model, variables, attention_masks.local(4, 1, radius=0))
    allowed = np.eye(17, dtype=bool)
    allowed[:, 0] = allowed[0, :] = True
    for attention in maps:
        assert np.all(np.asarray(attention)[..., ~allowed] == 0.0)
        np.testing.assert_allclose(np.asarray(attention).sum(-1), 1.0, rtol=1e-5)
        assert np.all(np.asarray(attention)[:, :, 0, :] > 0)  # the class token still sees all
    assert not np.allclose(logits, model.apply(variables, IMAGES, train=False), atol=1e-4)


@pytest.mark.parametrize("radius", [0, 1, 2, 5])
def test_the_random_baseline_masks_exactly_as_many_pairs(radius):
    local = attention_masks.local(7, 1, radius)
    random = attention_masks.random_like(local, 1, seed=3)
    assert attention_masks.masked_pairs(random, 1) == attention_masks.masked_pairs(local, 1)
    assert random[0].all() and random[:, 0].all() and np.diag(random).all()
    np.testing.assert_array_equal(random, attention_masks.random_like(local, 1, seed=3))
    if radius in (1, 2):
        assert (random != local).any()


def test_no_patch_attention_without_a_class_token_keeps_the_patch_itself():
    assert (attention_masks.no_patch_to_patch(3, 0) == np.eye(9, dtype=bool)).all()
    with_cls = attention_masks.no_patch_to_patch(3, 1)
    assert with_cls[:, 0].all() and with_cls[0].all() and with_cls[1:, 1:].sum() == 0


# --------------------------------------------------------------------------------------
# the analyses on the demo checkpoint

QUICK = {"analysis.num_examples": 64, "analysis.lesion_samples": 3, "analysis.spatial_examples": 64}


def _analyze(demo_run, data_dir, out, analyses, **overrides):
    config = smoke_config(data_dir, **{**QUICK, **overrides})
    return driver.run_analyses(config, analyses=analyses, workdir=str(demo_run[0]), out=str(out))


@pytest.fixture(scope="module")
def demo_analyses(demo_run, digits_data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("analysis")
    single_point = {
        "analysis.max_translation": 0.0,
        "analysis.translations": 1,
        "analysis.max_rotation": 0.0,
        "analysis.rotations": 1,
    }
    results = _analyze(
        demo_run,
        digits_data_dir,
        out,
        "layer_correlation,lesion,restricted_attention,spatial_attack",
        **single_point,
    )
    return out, results


def test_every_analysis_writes_json_figure_and_summary(demo_analyses):
    out, results = demo_analyses
    summary = (out / "summary.md").read_text()
    for name, result in results.items():
        assert "skipped" not in result, result
        assert json.loads((out / f"{name}.json").read_text())["seconds"] >= 0
        assert (out / "figures" / f"{name}.png").stat().st_size > 0
        assert f"## {name}" in summary
    correlation = results["layer_correlation"]
    assert correlation["num_examples"] == 64
    for key in ("pearson_all", "pearson_summary", "cka_all", "cka_summary"):
        np.testing.assert_allclose(np.diag(correlation[key]), 1.0, atol=1e-4)


def test_no_intervention_and_the_identity_grid_point_give_the_clean_accuracy(demo_analyses):
    _, results = demo_analyses
    clean = results["lesion"]["intact"]
    assert results["restricted_attention"]["unrestricted"] == clean
    assert results["spatial_attack"]["clean"] == results["spatial_attack"]["robust"] == clean
    radii = results["restricted_attention"]["radii"]
    assert radii == [0, 1, 2, 3]  # the smoke model's 4x4 grid
    assert results["restricted_attention"]["local"][-1] == clean  # radius 3 covers the grid


def test_more_grid_points_never_raise_robust_accuracy(
    demo_run, digits_data_dir, tmp_path, demo_analyses
):
    clean = demo_analyses[1]["spatial_attack"]["robust"]
    robust = []
    for translations, rotations in ((3, 1), (3, 3)):
        result = _analyze(
            demo_run,
            digits_data_dir,
            tmp_path,
            "spatial_attack",
            **{
                "analysis.max_translation": 2.0,
                "analysis.translations": translations,
                "analysis.max_rotation": 20.0,
                "analysis.rotations": rotations,
            },
        )
        robust.append(result["spatial_attack"]["robust"])
        assert result["spatial_attack"]["clean"] == clean
    assert robust[1] <= robust[0] <= clean


def test_unknown_analysis_is_named(demo_run, digits_data_dir, tmp_path):
    with pytest.raises(ValueError, match="lesion"):
        _analyze(demo_run, digits_data_dir, tmp_path, "lesions")


def test_cli_runs_an_analysis_and_refuses_stray_arguments(demo_run, digits_data_dir, tmp_path):
    common = [
        "-m",
        "rspc_jax.analyze",
        f"--config={REPO}/configs/demo.py:smoke",
        f"--workdir={demo_run[0]}",
        f"--config.data_dir={digits_data_dir}",
        f"--out={tmp_path}",
        "--config.analysis.num_examples=16",
    ]
    result = run_python(common + ["--analysis=layer_correlation"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cka_all:" in result.stdout
    assert json.loads((tmp_path / "layer_correlation.json").read_text())["num_examples"] == 16
    stray = run_python(common + ["lesion"], timeout=300)
    assert stray.returncode != 0 and "unexpected arguments: lesion" in stray.stderr
