"""`python -m rspc_jax.evaluate`: the suites on the demo checkpoint and on generated
benchmark folders (each checked against a direct computation), exact counting on 8
devices, and the report with its figures."""

import json

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image
import pytest

from rspc_jax import ConfigError
from rspc_jax.data import specs as datasets
from rspc_jax.evaluation import protocols, registry
from rspc_jax.evaluation import run_suites as evaluate_lib
from rspc_jax.evaluation.suites import cifar10_c, imagenet_a, imagenet_c
from rspc_jax.training import setup
from tests.conftest import run_python, smoke_config

QUICK = {
    "evaluation.occlusion_masks": 4,
    "evaluation.figure_images": 2,
    "evaluation.apgd_iters": 10,
    "evaluation.apgd_targets": 2,
    "evaluation.square_queries": 100,
    "evaluation.patch_fool_steps": 5,
    "evaluation.adversarial_examples": 48,
    "evaluation.corruptions": "gaussian_noise,fog",
    "evaluation.severities": (2,),
}


def _evaluate(demo_run, data_dir, out, suites, **overrides):
    config = smoke_config(data_dir, **{**QUICK, **overrides})
    return evaluate_lib.run_suites(config, workdir=str(demo_run[0]), suites=suites, out=str(out))


@pytest.fixture(scope="module")
def demo_report(demo_run, digits_data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    results = _evaluate(
        demo_run,
        digits_data_dir,
        out,
        "clean,corrupted_local,patch_occlusion,attention_stability,adversarial",
    )
    return out, results


def test_report_json_and_figures_of_every_suite(demo_report):
    out, results = demo_report
    report = (out / "report.md").read_text()
    for suite in results:
        assert "skipped" not in results[suite], results[suite]
        assert json.loads((out / f"{suite}.json").read_text())["seconds"] >= 0
        assert f"## {suite}" in report
    figures = {p.name for p in (out / "figures").iterdir()}
    assert {
        "occlusion_boxplot.png",
        "learned_masks.png",
        "cos_sim_histogram.png",
        "corrupted_local_errors.png",
        "adversarial.png",
        "attention_maps_0.png",
        "attention_maps_1.png",
    } <= figures
    assert results["clean"]["num_examples"] == 297
    # corrupted_local: its own label, and two corruptions at one severity.
    assert "NOT the released" in results["corrupted_local"]["note"]
    assert set(results["corrupted_local"]["accuracy"]) == {"gaussian_noise/2", "fog/2"}


def test_attacks_on_the_demo_model_order_and_stay_in_budget(demo_report):
    _, results = demo_report
    accuracy = results["adversarial"]["accuracy"]
    assert results["adversarial"]["num_examples"] == 48
    assert accuracy["pgd"] <= accuracy["fgsm"] <= accuracy["clean"]
    assert accuracy["autoattack"] <= accuracy["apgd_ce"] <= accuracy["clean"]
    assert accuracy["patch_fool"] <= accuracy["clean"]
    assert results["adversarial"]["max_pgd_linf"] <= 8 / 255 + 1e-6


def test_the_autoattack_cascade_reports_each_stage(demo_report):
    """Each stage runs on the points the previous ones left; the report has a row per stage."""
    out, results = demo_report
    accuracy = results["adversarial"]["accuracy"]
    cascade = results["adversarial"]["autoattack"]
    stages = cascade["stages"]
    assert [stage["attack"] for stage in stages] == ["apgd_ce", "apgd_t", "fab_t", "square"]
    assert stages[0]["attacked"] == round(accuracy["clean"] * 48)
    for before, after in zip(stages, stages[1:]):
        assert after["attacked"] == before["attacked"] - before["broken"]
    for stage in stages:
        assert stage["robust_accuracy"] * 48 == pytest.approx(stage["attacked"] - stage["broken"])
    assert cascade["robust_accuracy"] == accuracy["autoattack"] == stages[-1]["robust_accuracy"]
    assert stages[0]["robust_accuracy"] == accuracy["apgd_ce"]
    report = (out / "report.md").read_text()
    assert "AutoAttack standard, eps 4/255 (%)" in report
    assert "AutoAttack after Square (100 queries) (%)" in report


def test_nothing_occluded_gives_clean_accuracy_and_unit_cos_sim(
    demo_run, digits_data_dir, tmp_path
):
    results = _evaluate(
        demo_run,
        digits_data_dir,
        tmp_path,
        "patch_occlusion,attention_stability",
        **{"evaluation.occlusion_rho": 0.0},
    )
    occlusion = results["patch_occlusion"]
    assert occlusion["occluded_patches"] == 0
    assert occlusion["per_mask_accuracy"] == [occlusion["clean_accuracy"]] * 4
    clean = occlusion["clean_accuracy"]
    assert occlusion["every_mask_accuracy"] == dict(masks=1, mean=clean, worst_case=clean)
    assert results["attention_stability"]["mean_cos_sim"] == pytest.approx(1.0, abs=1e-5)
    assert results["attention_stability"]["per_image"]["min"] == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("rho, occluded", [(0.05, 1), (0.1, 2)])
def test_greedy_adaptive_masks_against_the_exact_worst_case(
    demo_run, digits_data_dir, tmp_path, rho, occluded
):
    """With the every-mask pass's noise: for 1 patch the greedy search tries every mask, so
    it is the exact worst case image by image; for 2 it can only miss masks (bound above)."""
    results = _evaluate(
        demo_run,
        digits_data_dir,
        tmp_path,
        "patch_occlusion,adaptive_occlusion",
        **{"evaluation.occlusion_rho": rho},
    )
    every, greedy = results["patch_occlusion"]["every_mask_accuracy"], results["adaptive_occlusion"]
    assert greedy["occluded_patches"] == occluded and greedy["num_patches"] == 16
    assert greedy["evaluations_per_image"] == occluded * 17
    if occluded == 1:
        assert greedy["accuracy"] == every["worst_case"]
    assert every["worst_case"] <= greedy["accuracy"] <= every["mean"] + 1e-9
    assert len(greedy["accuracy_by_patches"]) == occluded
    assert greedy["accuracy_by_patches"][-1] == greedy["accuracy"]
    assert "greedy adaptive masks (%)" in (tmp_path / "report.md").read_text()


def test_transfer_from_the_run_itself_is_its_own_masks(demo_run, digits_data_dir, tmp_path):
    """A run attacked by its own C's masks (the same noise) scores what patch_occlusion's
    'trained corruption model's mask' gives; a relative path names the same run."""
    workdir = demo_run[0]
    results = _evaluate(
        demo_run,
        digits_data_dir,
        tmp_path,
        "patch_occlusion,transfer_occlusion",
        **{"evaluation.transfer_from": str(workdir)},
    )
    transfer, own = results["transfer_occlusion"], results["patch_occlusion"]
    assert transfer["accuracy"] == own["learned_mask_accuracy"]
    assert transfer["distinct_masks"] == own["selection"]["distinct_masks"]
    assert transfer["source"] == str(workdir) and transfer["source_corruption_model"] == "official"


def _copied_run_config(demo_run, tmp_path, **changes):
    """A folder holding the demo run's config.json with top-level or rspc `changes`."""
    config = json.loads((demo_run[0] / "config.json").read_text())
    for key, value in changes.items():
        (config["rspc"] if key in config["rspc"] else config)[key] = value
    folder = tmp_path / "source"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_a_transfer_source_that_cannot_attack_is_refused_with_the_fix(
    demo_run, digits_data_dir, tmp_path
):
    results = _evaluate(demo_run, digits_data_dir, tmp_path / "none", "transfer_occlusion")
    assert "evaluation.transfer_from" in results["transfer_occlusion"]["skipped"]
    cases = [
        (str(tmp_path), "no config.json"),
        (_copied_run_config(demo_run, tmp_path / "a", image_size=48), "image_size 48"),
        (_copied_run_config(demo_run, tmp_path / "b", selection="random"), "learned selection"),
    ]
    for source, words in cases:
        with pytest.raises(ConfigError, match=words):
            _evaluate(
                demo_run,
                digits_data_dir,
                tmp_path / "out",
                "transfer_occlusion",
                **{"evaluation.transfer_from": source},
            )


def test_every_mask_is_each_way_to_occlude_k_patches_once():
    from rspc_jax.evaluation import occlusion

    masks = occlusion.every_keep_mask(16, 2)
    assert masks.shape == (120, 16)
    np.testing.assert_array_equal((masks == 0).sum(axis=1), 2)
    assert len({m.tobytes() for m in masks}) == 120


_COUNT_SCRIPT = """
import json
import jax
from tests.conftest import smoke_config
from rspc_jax.evaluation import run_suites as evaluate
assert jax.device_count() == 8
config = smoke_config({data_dir!r}, eval_split="test[:293]", **{{"evaluation.batch_size": 64}})
result = evaluate.run_suites(config, workdir={workdir!r}, suites="clean", out={out!r})
print(json.dumps(result["clean"]))
"""


def test_eight_devices_count_a_prime_sized_split_once(demo_run, digits_data_dir, tmp_path):
    script = _COUNT_SCRIPT.format(
        data_dir=digits_data_dir, workdir=str(demo_run[0]), out=str(tmp_path / "eight")
    )
    result = run_python(["-c", script], devices=8, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    eight = json.loads(result.stdout.strip().splitlines()[-1])
    one = _evaluate(
        demo_run,
        digits_data_dir,
        tmp_path / "one",
        "clean",
        eval_split="test[:293]",
        **{"evaluation.batch_size": 64},
    )["clean"]
    assert eight["num_examples"] == one["num_examples"] == 293
    assert eight["top1"] == one["top1"]
    assert eight["loss"] == pytest.approx(one["loss"], rel=1e-5)


# --------------------------------------------------------------------------------------
# Released-benchmark suites on generated folders, against a direct computation


@pytest.fixture(scope="module")
def imagenet_model(digits_data_dir):
    """A random 1000-class tiny ViT at 32 px, with its Context and a direct predictor."""
    config = smoke_config(digits_data_dir, dataset="imagenet2012", image_size=32)
    spec = datasets.dataset_spec("imagenet2012")
    model = setup.build_model(config, spec.num_classes)
    variables = model.init(jax.random.PRNGKey(1), jnp.zeros((1, 32, 32, 3)), train=False)
    ctx = evaluate_lib.build_context(config, model, variables)

    def logits(pixels_uint8):
        x = (pixels_uint8 / 255.0 - np.asarray(spec.mean)) / np.asarray(spec.std)
        return np.asarray(model.apply(variables, jnp.asarray(x, jnp.float32), train=False))

    return ctx, logits


def _write_folders(root, wnids, images, label_of):
    """PNG `images` into <root>/<wnid>/, image i into the folder of class label_of[i]."""
    for wnid in wnids:
        (root / wnid).mkdir(parents=True)
    for i, (image, label) in enumerate(zip(images, label_of)):
        Image.fromarray(image).save(root / wnids[label] / f"{i}.png")


def test_imagenet_c_folders_centre_crop_and_label_by_sorted_wnid(imagenet_model, tmp_path):
    ctx, logits = imagenet_model
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (1100, 40, 40, 3), dtype=np.uint8)
    predicted = logits(images[:, 4:36, 4:36]).argmax(-1)
    # Every one of the 1000 folders needs an image: the first 1000 go one per class
    # (mostly wrong), the last 100 into the folder of their own prediction (right).
    label_of = np.concatenate([np.arange(1000), predicted[1000:]])
    wnids = [f"n{i:08d}" for i in range(1000)]
    _write_folders(tmp_path / "gaussian_noise" / "3", wnids, images, label_of)
    ctx.settings.update(
        dict(imagenet_c_dir=str(tmp_path), corruptions="gaussian_noise", severities=(3,))
    )
    result = imagenet_c.run(ctx)
    expected = float((predicted == label_of).mean())
    assert expected > 100 / 1100
    assert result["accuracy"] == {"gaussian_noise/3": pytest.approx(expected)}
    assert result["mce"] is None and ["gaussian_noise", 1] in result["missing"]


def test_imagenet_a_folders_restrict_the_logits_to_200_classes(imagenet_model, tmp_path):
    ctx, logits = imagenet_model
    rng = np.random.default_rng(1)
    # The run's ImageNet eval preprocessing: shorter side to 32 / 0.875 = 36 px (here the
    # identity), then the central 32 x 32 crop.
    images = rng.integers(0, 256, (300, 36, 36, 3), dtype=np.uint8)
    restricted = protocols.restricted_prediction(
        logits(images[:, 2:34, 2:34]), protocols.IMAGENET_A_INDICES
    )
    position = {int(c): i for i, c in enumerate(protocols.IMAGENET_A_INDICES)}
    label_of = np.concatenate([np.arange(200), [position[int(c)] for c in restricted[200:]]])
    _write_folders(tmp_path, list(protocols.IMAGENET_A_WNIDS), images, label_of)
    ctx.settings.update(dict(imagenet_a_dir=str(tmp_path)))
    result = imagenet_a.run(ctx)
    expected = float((restricted == protocols.IMAGENET_A_INDICES[label_of]).mean())
    assert expected >= 100 / 300
    assert result["top1"] == pytest.approx(expected) and result["num_examples"] == 300


def test_cifar10_c_npy_severity_blocks(demo_run, digits_data_dir, tmp_path):
    config = smoke_config(
        digits_data_dir,
        **{"evaluation.cifar10_c_dir": str(tmp_path), "evaluation.corruptions": "fog"},
    )
    spec = datasets.dataset_spec(config.dataset)
    model = setup.build_model(config, spec.num_classes)
    variables, _, _ = evaluate_lib.load_variables(
        config, model, workdir=str(demo_run[0]), checkpoint=None, step=None, ema=False
    )
    rng = np.random.default_rng(2)
    images = rng.integers(0, 256, (5 * 12, 32, 32, 3), dtype=np.uint8)
    labels = np.tile(rng.integers(0, 10, 12), 5).astype(np.uint8)
    np.save(tmp_path / "fog.npy", images)
    np.save(tmp_path / "labels.npy", labels)
    x = (images / 255.0 - np.asarray(spec.mean)) / np.asarray(spec.std)
    correct = (
        np.asarray(model.apply(variables, jnp.asarray(x, jnp.float32), train=False)).argmax(-1)
        == labels
    )
    result = cifar10_c.run(evaluate_lib.build_context(config, model, variables))
    for severity in range(1, 6):
        block = correct[(severity - 1) * 12 : severity * 12]
        assert result["accuracy"][f"fog/{severity}"] == pytest.approx(block.mean())
    assert result["per_corruption"] == {"fog": pytest.approx(correct.mean())}
    assert result["mean_accuracy"] is None  # 14 of the 15 corruptions missing


def test_a_suite_without_data_or_a_matching_model_is_skipped_with_the_fix(
    demo_run, digits_data_dir, tmp_path
):
    results = _evaluate(demo_run, digits_data_dir, tmp_path, "imagenet_c,cifar10_c,cifar100_c")
    assert "1000-class model" in results["imagenet_c"]["skipped"]
    assert "cifar10_c_dir" in results["cifar10_c"]["skipped"]
    assert "tfds build cifar10_corrupted" in results["cifar10_c"]["skipped"]
    assert "100-class model" in results["cifar100_c"]["skipped"]
    assert "skipped" in (tmp_path / "report.md").read_text()


# --------------------------------------------------------------------------------------
# The registry of plug-ins


def test_every_registered_plugin_has_its_run_and_rows():
    for kind, names in (("suite", registry.SUITES), ("analysis", registry.ANALYSES)):
        for name in names:
            plugin = registry.plugin(kind, name)
            assert callable(plugin.run) and callable(plugin.rows), (kind, name)


def test_an_unknown_suite_names_the_close_ones():
    with pytest.raises(ConfigError, match="Did you mean patch_occlusion"):
        registry.names("suite", "clean,patch_oclusion")
    with pytest.raises(ConfigError, match="no analysis named"):
        registry.names("analysis", ",")


def test_relative_evaluation_paths_resolve_against_the_working_directory(tmp_path, monkeypatch):
    """A relative transfer source or data folder names the same place in every tool and in
    the config.json a run writes."""
    from rspc_jax.tools import cli

    monkeypatch.chdir(tmp_path)
    config = smoke_config("data")
    config.evaluation.transfer_from = "runs/source"
    config.evaluation.imagenet_c_dir = ""
    cli.resolve_config_paths(config)
    assert config.evaluation.transfer_from == str(tmp_path / "runs" / "source")
    assert config.data_dir == str(tmp_path / "data")
    assert config.evaluation.imagenet_c_dir == ""
