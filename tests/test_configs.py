"""Every config file loads, validates and builds its model; CIFAR trains on tfds mock data."""

import json

from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow_datasets as tfds

from rspc_jax.data import specs as datasets
from rspc_jax.training import ablations, setup
from rspc_jax.training import loop as train
from tests.conftest import REPO, load_config

CONFIGS = sorted((REPO / "configs").glob("*.py"))
VARIANTS = {path.name: [None, "plain", "smoke"] for path in CONFIGS}
VARIANTS.update(
    {
        "xcit_s12_adv.py": [None, "m12", "l12", "smoke"],
        "cifar10_xcit_s12_adv.py": [None, "smoke"],
        "demo_study.py": [
            None,
            "smoke",
            "payoff",
            "payoff_validation",
            "payoff_headline",
            "payoff_schedule",
            "payoff_schedule_validation",
            "payoff_diversity_validation",
            "payoff_diversity",
            "payoff36",
            "payoff_transfer16",
            "payoff_adaptive16",
            "payoff_object16",
            "attention16_validation",
            "attention16",
        ],
    }
)
# An ablation is a variant of any config (configs/<base>.py:<name>); a few that build models.
VARIANTS["demo.py"] += ["clean"]
VARIANTS["rvt_b.py"] += ["random_patches"]
VARIANTS["fan_b_hybrid.py"] += ["trades2"]
VARIANTS["xcit_s12.py"] += ["zero_fill"]
VARIANTS["deit_s.py"] += ["drop_tokens"]


def test_the_issue_configs_exist():
    expected = {
        "rvt_ti.py",
        "rvt_s.py",
        "rvt_b.py",
        "fan_t_hybrid.py",
        "fan_s_hybrid.py",
        "fan_b_hybrid.py",
        "deit_s.py",
        "xcit_s12.py",
        "cifar10_rvt_s.py",
        "cifar100_rvt_s.py",
        "cifar10_fan_s_hybrid.py",
        "cifar100_fan_s_hybrid.py",
    }
    assert expected <= set(VARIANTS)


@pytest.mark.parametrize("name,arg", [(n, a) for n, args in VARIANTS.items() for a in args])
def test_config_validates_and_builds_its_model(name, arg):
    module, config = load_config(REPO / "configs" / name, arg)
    assert f"python -m rspc_jax.main --config=configs/{name}" in module.__doc__
    setup.validate_config(config)
    spec = datasets.dataset_spec(config.dataset)
    model = setup.build_model(config, spec.num_classes)
    setup.check_model_fits(config, model)
    shape = (1, config.image_size, config.image_size, 3)
    variables = jax.eval_shape(
        lambda: model.init(jax.random.PRNGKey(0), jnp.zeros(shape), train=False)
    )
    assert jax.tree.leaves(variables["params"])


def test_unknown_variant_is_rejected():
    with pytest.raises(ValueError, match="unknown variant"):
        load_config(REPO / "configs" / "demo.py", "tiny")
    # 'plain' is RSPC off: an adversarial config has no such variant.
    with pytest.raises(ValueError, match="unknown variant 'plain'"):
        load_config(REPO / "configs" / "xcit_s12_adv.py", "plain")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_configs_import_the_package_never_another_config(path):
    """Shared pieces of configs live in rspc_jax (training/recipes.py): a config that loaded
    another by file path would hide what it depends on."""
    source = path.read_text()
    assert "importlib" not in source
    assert "spec_from_file_location" not in source


@pytest.mark.parametrize("name", sorted(ablations.ABLATIONS))
def test_an_ablation_is_a_variant_of_every_training_config(name):
    """`configs/<base>.py:<name>` is the config as written with the ablation's switches."""
    for path in CONFIGS:
        if path.name == "demo_study.py":  # a study: its methods name the ablations
            continue
        _, written = load_config(path)
        _, ablated = load_config(path, name)
        assert ablated == ablations.apply(written, name), path.name


def test_cifar_smoke_trains_with_mixup_and_ema_on_mock_data(tmp_path):
    _, config = load_config(REPO / "configs" / "cifar10_vit_s.py", "smoke")
    config.data_dir = str(tmp_path / "data")
    with tfds.testing.mock_data(num_examples=64):
        result = train.train_and_evaluate(config, str(tmp_path / "run"))
    assert result["step"] == 4
    assert 0.0 <= result["eval"]["accuracy"] <= 1.0
    assert 0.0 <= result["eval_ema"]["accuracy"] <= 1.0


def test_adversarial_cifar_finetuning_smoke_keeps_the_best_fgsm_state(tmp_path):
    """TRADES on the stride-1 XCiT stem, colour jitter and the narrowed crops, FGSM evals
    and the best state in <workdir>/best (on tfds mock data)."""
    _, config = load_config(REPO / "configs" / "cifar10_xcit_s12_adv.py", "smoke")
    config.update(
        dict(
            data_dir=str(tmp_path / "data"),
            augment="imagenet",
            color_jitter=0.4,
            total_steps=4,
            eval_every_steps=2,
        )
    )
    with tfds.testing.mock_data(num_examples=64):
        result = train.train_and_evaluate(config, str(tmp_path / "run"))
    assert result["step"] == 4
    assert 0.0 <= result["eval"]["fgsm_accuracy"] <= 1.0
    best = tmp_path / "run" / "best"
    record = json.loads((best / "best.json").read_text())
    assert record["metric"] == "fgsm_accuracy" and record["step"] in (2, 4)
    assert (best / "checkpoints" / str(record["step"])).is_dir()
    assert (best / "config.json").is_file()


def test_rvt_smoke_trains_with_batchnorm_and_paas(digits_data_dir, tmp_path):
    _, config = load_config(REPO / "configs" / "rvt_b.py", "smoke")
    config.data_dir = digits_data_dir
    config.image_size = 64  # PAAS sizes its mask at init: the same path as 224 px, 12x fewer pixels
    result = train.train_and_evaluate(config, str(tmp_path / "run"))
    assert result["step"] == 3
    stats = traverse_util.flatten_dict(result["state"].batch_stats)
    assert stats and all(np.all(np.isfinite(v)) for v in stats.values())
    # Every running mean moved away from its zero initialisation during training.
    means = [v for path, v in stats.items() if path[-1] == "mean"]
    assert means and all(np.any(np.asarray(m) != 0) for m in means)
