"""configs/demo_study.py:smoke through rspc_jax.study: every run trained and evaluated,
results.md with the headline, the learned-vs-random pairs, C's selection statistics and the
figures; a resumed study that trains nothing again; bad methods fail before training."""

import json

import pytest

from rspc_jax import ConfigError
from rspc_jax.tools import study as study_runner
from tests.conftest import REPO, load_config


def _smoke_config(data_dir):
    _, config = load_config(REPO / "configs" / "demo_study.py", "smoke")
    config.data_dir = data_dir
    return config


def _row(text, start):
    return next(line for line in text.splitlines() if line.startswith(start))


def _setting_table(text, setting):
    """{method label: {column: cell}} of the table under '## <setting>: ...'."""
    lines = text.split(f"## {setting}: ")[1].split("\n\n")[1].splitlines()
    header = [h.strip() for h in lines[0].strip("|").split("|")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    return {row[0]: dict(zip(header, row, strict=True)) for row in rows}


def test_method_strings_switch_the_config(digits_data_dir):
    config = _smoke_config(digits_data_dir)
    paper = study_runner.run_config(
        config, "canvas16", "rspc lam=0.5 ste=identity corruption_grad_scale=1", seed=2
    )
    assert (paper.seed, paper.dataset, paper.rspc.enabled) == (2, "sklearn_digits_canvas", True)
    assert (paper.rspc.lam, paper.rspc.ste, paper.rspc.corruption_grad_scale) == (
        0.5,
        "identity",
        1.0,
    )
    random = study_runner.run_config(config, "centred16", "random_patches lam=0.5", seed=0)
    assert (random.dataset, random.rspc.selection, random.rspc.lam) == (
        "sklearn_digits",
        "random",
        0.5,
    )
    assert study_runner.label("random_patches lam=0.5") == "RSPC, random patches, λ=0.5"


def test_learned_methods_pair_with_the_random_method_of_their_other_fields():
    """Fields that change only how C selects do not split the pairing with random patches."""
    assert study_runner.random_twin("rspc lam=0.5") == "random_patches lam=0.5"
    assert (
        study_runner.random_twin("rspc lam=0.5 corruption_model=content temperature=1.0")
        == "random_patches lam=0.5"
    )
    rows = {
        "rspc lam=0.5 corruption_model=content": [dict(occluded=0.8, **{"Cos-Sim": 0.9})],
        "random_patches lam=0.5": [dict(occluded=0.7, **{"Cos-Sim": 0.95})],
        "rspc": [dict(occluded=0.6, **{"Cos-Sim": 0.9})],  # no random twin at lambda 0.005
    }
    ((method, differences),) = study_runner.learned_vs_random(rows, seeds=[0])
    assert method == "rspc lam=0.5 corruption_model=content"
    assert differences == {"occluded": [pytest.approx(0.1)], "Cos-Sim": [pytest.approx(-0.05)]}


def test_per_image_study_chooses_on_held_out_training_digits(digits_data_dir):
    """The validation variant trains on training digits 0-1199 and evaluates on 1200-1499;
    the per-image study itself evaluates on the test split."""
    _, validation = load_config(REPO / "configs" / "demo_study.py", "per_image_validation")
    _, final = load_config(REPO / "configs" / "demo_study.py", "per_image")
    assert (validation.train_split, validation.eval_split) == ("train[:1200]", "train[1200:]")
    assert final.train_split is None and final.eval_split is None
    for config in (validation, final):
        assert set(config.study.settings) == {"canvas16", "textured16"}
        study_runner.check(config)


@pytest.mark.parametrize("method", ["rspc lamda=0.5", "no_such_method"])
def test_bad_method_fails_before_training(digits_data_dir, tmp_path, method):
    config = _smoke_config(digits_data_dir)
    config.study.settings.centred16.methods = ("clean", method)
    with pytest.raises(ConfigError, match="config.study.settings"):
        study_runner.run_study(config, str(tmp_path), command="smoke")
    assert not (tmp_path / "runs").exists()


def test_smoke_study_writes_results_and_figures(digits_data_dir, tmp_path):
    config = _smoke_config(digits_data_dir)
    path = study_runner.run_study(config, str(tmp_path), command="smoke")
    results = (tmp_path / "results.md").read_text()
    assert path == str(tmp_path / "results.md")
    # The headline: every method of the smoke settings, a number where the setting has it.
    assert _row(results, "| method | canvas16 | centred16 |")
    assert _row(results, "| plain |").split("|")[2].strip() == "—"
    assert "—" not in _row(results, "| RSPC, random patches, λ=0.5 |").split("|")[2]
    # Learned against random: the lambda=0.5 pair of the canvas setting, one seed.
    assert _row(results, "| canvas16 | RSPC, λ=0.5 |")
    # C's statistics: on the test set for learned selection, from the log for both.
    canvas = _setting_table(results, "canvas16")
    learned, random = canvas["RSPC, λ=0.5"], canvas["RSPC, random patches, λ=0.5"]
    for column in ("C: distinct masks", "C: entropy", "C: on object", "λ·L_align/CE"):
        assert learned[column] not in ("", "—"), column
    # Random selection never trains C: its columns show C at initialisation.
    assert random["C: entropy"] != "—"
    assert float(random["entropy, last log"]) > 0.5  # random masks use every position
    assert _setting_table(results, "centred16")["plain"]["λ·L_align/CE"] == "—"
    record = json.loads(
        (
            tmp_path / "runs" / "canvas16" / "random_patches_lam=0.5_s0" / "study_run.json"
        ).read_text()
    )
    assert len(record["train_log"][-1]["train/selection_frequency"]) == 16
    for name in (
        "centred16_selection_over_training.png",
        "canvas16_selection_over_training.png",
        "canvas16_occluded_accuracy.png",
        "canvas16_learned_masks.png",
    ):
        assert (tmp_path / "figures" / name).stat().st_size > 0, name
        assert f"figures/{name}" in results
    # A second invocation finds every run finished and only rewrites the results.
    run = tmp_path / "runs" / "centred16" / "clean_s0"
    (run / "checkpoints").rename(tmp_path / "moved")
    study_runner.run_study(config, str(tmp_path), command="smoke")
    assert not (run / "checkpoints").exists()
