"""configs/demo_study.py:smoke through rspc_jax.study: every run trained and evaluated,
results.md with the headline, the learned-vs-random pairs, C's selection statistics and the
figures; a resumed study that trains nothing again; bad methods fail before training."""

import json

import pytest

from rspc_jax import ConfigError
from rspc_jax.interop import run_record
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
    ((method, differences),) = study_runner.learned_vs_random(rows)
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


def test_payoff_study_measures_unseen_corruptions_and_chooses_on_validation_digits():
    """The payoff study: the corruption suite on; its validation variant trains on
    training digits 0-1199 and evaluates on 1200-1499, the study itself on the test split."""
    _, validation = load_config(REPO / "configs" / "demo_study.py", "payoff_validation")
    _, final = load_config(REPO / "configs" / "demo_study.py", "payoff")
    assert (validation.train_split, validation.eval_split) == ("train[:1200]", "train[1200:]")
    assert final.train_split is None and final.eval_split is None
    assert validation.study.seeds == (0,) and len(final.study.seeds) == 8
    for config in (validation, final):
        assert "corrupted_local" in config.evaluation.suites.split(",")
        assert set(config.study.settings) == {"canvas16", "textured16"}
        study_runner.check(config)
        methods = config.study.settings.canvas16.methods
        assert {"clean", "random_patches lam=0.5", "rspc lam=0.5"} <= set(methods)
        # every learned method pairs with random patches at lambda 0.5
        learned = [m for m in methods if m.startswith("rspc")]
        assert {study_runner.random_twin(m) for m in learned} == {"random_patches lam=0.5"}


def test_payoff_headline_runs_the_chosen_c_against_both_baselines_on_the_same_runs():
    """The headline part of the payoff study: the validation's choice (the official C at
    lambda 0.5) with random patches and plain training, every run one the full study also
    has (same run directory), so seeds finished by either count for both; it has twice the
    full study's seeds (docs/study/findings.md: 8 left the paired SE above 1 point)."""
    _, full = load_config(REPO / "configs" / "demo_study.py", "payoff")
    _, headline = load_config(REPO / "configs" / "demo_study.py", "payoff_headline")
    study_runner.check(headline)
    assert headline.study.seeds == tuple(range(16))
    assert headline.study.seeds[: len(full.study.seeds)] == full.study.seeds
    assert headline.evaluation.to_dict() == full.evaluation.to_dict()
    for setting, spec in headline.study.settings.items():
        assert tuple(spec.methods) == ("clean", "random_patches lam=0.5", "rspc lam=0.5")
        assert set(spec.methods) < set(full.study.settings[setting].methods)
        assert spec.config.to_dict() == full.study.settings[setting].config.to_dict()


@pytest.mark.parametrize(
    "name,switches",
    [
        ("schedule", {"corruption_warmup_epochs", "corruption_curriculum_epochs"}),
        ("diversity", {"corruption_diversity"}),
    ],
)
def test_payoff_remedy_chooses_on_validation_and_adds_the_choice_to_the_headline_runs(
    name, switches
):
    """The schedules on C's objective and the diversity term: the candidates and their
    random twin on the validation digits; the test variant is the headline's runs plus the
    choice, so that every baseline run is reused (same evaluation, same settings)."""
    _, validation = load_config(REPO / "configs" / "demo_study.py", f"payoff_{name}_validation")
    _, test = load_config(REPO / "configs" / "demo_study.py", f"payoff_{name}")
    _, headline = load_config(REPO / "configs" / "demo_study.py", "payoff_headline")
    assert (validation.train_split, validation.eval_split) == ("train[:1200]", "train[1200:]")
    assert validation.study.seeds == (0,) and test.study.seeds == tuple(range(8))
    assert test.evaluation.to_dict() == headline.evaluation.to_dict()
    for config in (validation, test):
        study_runner.check(config)
    candidates = validation.study.settings.canvas16.methods
    learned = [m for m in candidates if m.startswith("rspc") and m != "rspc lam=0.5"]
    assert {m.split()[-1].partition("=")[0] for m in learned} == switches
    assert "random_patches lam=0.5" in candidates
    for setting, spec in test.study.settings.items():
        chosen = set(spec.methods) - set(headline.study.settings[setting].methods)
        assert len(chosen) == 1 and chosen <= set(candidates)
        assert set(headline.study.settings[setting].methods) < set(spec.methods)
        assert study_runner.random_twin(chosen.pop()) == "random_patches lam=0.5"


def test_payoff36_has_36_tokens_the_greedy_search_and_an_independent_transfer_source():
    """The setting with more tokens: 48 px in 8 px patches (36 tokens, 4 of them occluded:
    too many masks for the exact worst case), the greedy and transfer suites, a content C
    on a seed the study never uses as the transfer source, refused on a study seed."""
    _, config = load_config(REPO / "configs" / "demo_study.py", "payoff36")
    study_runner.check(config)
    (setting,) = config.study.settings.values()
    assert setting.config.image_size // config.model.patch_size == 6
    assert {"corrupted_local", "adaptive_occlusion", "transfer_occlusion"} <= set(
        config.evaluation.suites.split(",")
    )
    assert "corruption_model=content" in config.study.transfer.method
    assert config.study.transfer.seed not in config.study.seeds
    config.study.transfer.seed = 3
    with pytest.raises(ConfigError, match="independently"):
        study_runner.check(config)
    config.study.transfer.seed, config.study.transfer.method = 100, "random_patches lam=0.5"
    with pytest.raises(ConfigError, match="learns no masks"):
        study_runner.check(config)


def test_payoff_transfer16_attacks_the_16_token_runs_with_one_content_c_per_setting():
    """The transfer attack at 16 tokens: `:payoff_diversity`'s settings and methods (so the
    same run directories), every run under the masks of a content C on a seed no run uses,
    the worst case over every mask kept."""
    _, config = load_config(REPO / "configs" / "demo_study.py", "payoff_transfer16")
    _, diversity = load_config(REPO / "configs" / "demo_study.py", "payoff_diversity")
    study_runner.check(config)
    assert dict(config.study.settings) == dict(diversity.study.settings)
    assert {"patch_occlusion", "transfer_occlusion"} <= set(config.evaluation.suites.split(","))
    assert "corruption_model=content" in config.study.transfer.method
    assert config.study.transfer.seed not in config.study.seeds


def test_payoff_adaptive16_puts_the_content_c_under_the_greedy_search_at_16_tokens():
    """The 36-token hypothesis tested at 16 tokens: plain, random patches and the content C,
    with `:payoff`'s settings and run names, under the greedy search and every mask."""
    _, config = load_config(REPO / "configs" / "demo_study.py", "payoff_adaptive16")
    _, payoff = load_config(REPO / "configs" / "demo_study.py", "payoff")
    study_runner.check(config)
    assert set(config.study.settings) == set(payoff.study.settings) == {"canvas16", "textured16"}
    for name, spec in config.study.settings.items():
        assert set(spec.methods) < set(payoff.study.settings[name].methods)
        assert any("corruption_model=content" in m for m in spec.methods)
    assert {"patch_occlusion", "adaptive_occlusion"} <= set(config.evaluation.suites.split(","))


def test_payoff_object16_adds_random_digit_patches_to_the_adaptive16_runs():
    """The control shares `:payoff_adaptive16`'s runs and adds random patches on the digit,
    which the report pairs with the content C in a table of its own."""
    _, config = load_config(REPO / "configs" / "demo_study.py", "payoff_object16")
    _, adaptive = load_config(REPO / "configs" / "demo_study.py", "payoff_adaptive16")
    study_runner.check(config)
    assert set(config.study.seeds) <= set(adaptive.study.seeds)
    assert config.evaluation.suites == adaptive.evaluation.suites
    for name, spec in config.study.settings.items():
        added = set(spec.methods) - set(adaptive.study.settings[name].methods)
        assert added == {"random_object_patches lam=0.5"}
        run = study_runner.run_config(config, name, added.pop(), seed=0)
        assert (run.rspc.selection, run.rspc.lam) == ("random_object", 0.5)
    rows = {
        "rspc lam=0.5 corruption_model=content temperature=1.0": [{"greedy, 1 patch": 0.3}],
        "random_patches lam=0.5": [{"greedy, 1 patch": 0.2}],
        "random_object_patches lam=0.5": [{"greedy, 1 patch": 0.25}],
    }
    ((_, on_digit),) = study_runner.learned_vs_random(rows, "random_object_patches")
    assert on_digit == {"greedy, 1 patch": [pytest.approx(0.05)]}
    ((_, anywhere),) = study_runner.learned_vs_random(rows)
    assert anywhere == {"greedy, 1 patch": [pytest.approx(0.1)]}


def test_every_run_of_a_study_meets_the_masks_of_one_transfer_source(digits_data_dir, tmp_path):
    """The source trains once per setting (its own run directory, its seed), every run is
    evaluated with its masks and (added after the runs finished, evaluated without training
    them again) the greedy search, and the report pairs both."""
    config = _smoke_config(digits_data_dir)
    config.study.settings = dict(
        canvas16=dict(
            about="transfer",
            config=dict(dataset="sklearn_digits_canvas"),
            methods=("clean", "random_patches lam=0.5", "rspc lam=0.5"),
        )
    )
    config.study.transfer = dict(method="rspc lam=0.5 corruption_model=content", seed=100)
    config.evaluation.suites = "clean,patch_occlusion,transfer_occlusion"
    study_runner.run_study(config, str(tmp_path), command="transfer")
    # A suite added after the runs finished: evaluated on their checkpoints, nothing trained.
    config.evaluation.suites += ",adaptive_occlusion"
    plain = tmp_path / "runs" / "canvas16" / "clean_s0"
    log, first_report = (plain / "metrics.jsonl").read_text(), (plain / "eval" / "report.md")
    first_report = first_report.read_text()
    study_runner.run_study(config, str(tmp_path), command="added", reevaluate=["clean"])
    assert (plain / "metrics.jsonl").read_text() == log
    assert (plain / "eval" / "report.md").read_text() == first_report
    assert (plain / "eval" / "clean+adaptive_occlusion" / "report.md").exists()
    record = json.loads((plain / "study_run.json").read_text())
    assert record["reevaluated"] == ["adaptive_occlusion", "clean"]
    source = (
        tmp_path
        / "runs"
        / "canvas16"
        / "transfer_source_rspc_lam=0.5_corruption_model=content_s100"
    )
    assert json.loads((source / "config.json").read_text())["seed"] == 100
    for method in ("clean", "rspc_lam=0.5"):
        record = json.loads(
            (tmp_path / "runs" / "canvas16" / f"{method}_s0" / "study_run.json").read_text()
        )
        transfer = record["results"]["transfer_occlusion"]
        assert (
            transfer["source"] == str(source) and transfer["source_corruption_model"] == "content"
        )
        assert 0 <= record["results"]["adaptive_occlusion"]["accuracy"] <= 1
    results = (tmp_path / "results.md").read_text()
    header = results.split("## Learned against random")[1].split("\n\n")[2].splitlines()[0]
    assert "| worst case | greedy | greedy, 1 patch | transfer | clean |" in header
    assert "## Transfer sources" in results and "- canvas16: clean " in results


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


def _fake_record(accuracy: float, corruption_error: float) -> dict:
    """A finished run's record with the numbers the report reads: clean, occluded, worst
    case and every corrupted_local cell (error `corruption_error` on all of them)."""
    cells = {f"{c}/{s}": 1 - corruption_error for c in ("fog", "snow") for s in (1, 2)}
    return dict(
        train_seconds=30.0,
        eval_seconds=20.0,
        train_log=[{"step": 1, "train/loss": 1.0}],
        results=dict(
            clean=dict(top1=accuracy),
            patch_occlusion=dict(
                random_mask_accuracy=dict(mean=accuracy - 0.1, min=0.2),
                every_mask_accuracy=dict(mean=accuracy - 0.1, worst_case=0.01),
            ),
            corrupted_local=dict(
                accuracy=cells,
                corruptions=["fog", "snow"],
                severities=[1, 2],
                mean_accuracy=1 - corruption_error,
            ),
        ),
    )


def test_corruption_error_is_relative_to_plain_training():
    plain, half = _fake_record(0.9, 0.4), _fake_record(0.9, 0.2)
    result = half["results"]["corrupted_local"]
    assert study_runner.corruption_error(result, plain["results"]["corrupted_local"]) == (
        pytest.approx(0.5)
    )
    rows = {"s": {"clean": [{}], "rspc": [{}]}}
    study_runner.add_corruption_errors(rows, {"s": {"clean": {0: plain}, "rspc": {0: half}}})
    assert rows["s"]["rspc"][0]["mCE vs plain"] == pytest.approx(0.5)
    assert rows["s"]["clean"][0]["mCE vs plain"] == pytest.approx(1.0)


def test_study_in_parts_reports_every_finished_seed_with_paired_differences(
    digits_data_dir, tmp_path
):
    """Runs finished by earlier parts are not trained again; the report covers the seeds
    whose runs are all finished, pairs learned with random and every method with plain
    (mean ± std, SE, per seed) and lists each part's wall-clock."""
    config = _smoke_config(digits_data_dir)
    methods = ("clean", "random_patches lam=0.5", "rspc lam=0.5")
    config.study.settings = dict(
        canvas16=dict(about="parts", config=dict(dataset="sklearn_digits_canvas"), methods=methods)
    )
    config.study.seeds = (0, 1, 2)
    # the suites the fake records hold (a suite they lacked would be evaluated on checkpoints)
    config.evaluation.suites = "clean,patch_occlusion,corrupted_local"
    numbers = {"clean": (0.8, 0.5), "random_patches lam=0.5": (0.85, 0.4), "rspc lam=0.5": None}
    for seed in (0, 1, 2):
        for method in methods if seed < 2 else ("clean",):  # seed 2 unfinished
            accuracy, error = numbers[method] or (0.86 + 0.01 * seed, 0.45)
            run = tmp_path / "runs" / "canvas16" / f"{method.replace(' ', '_')}_s{seed}"
            run.mkdir(parents=True)
            (run / "study_run.json").write_text(json.dumps(_fake_record(accuracy, error)))
    # One run resumed with another learning rate after step 2 (--accept_config_change).
    changed = tmp_path / "runs" / "canvas16" / "clean_s1"
    (changed / "checkpoints" / "6").mkdir(parents=True)
    run_record.record_change(str(changed), {}, {}, {"optimizer.lr": (0.016, 0.01)}, step=2)
    with pytest.raises(ConfigError, match="--settings"):
        study_runner.run_study(config, str(tmp_path), "part", settings=["nowhere"])
    study_runner.run_study(config, str(tmp_path), "part 1", settings=["canvas16"], seeds=[0, 1])
    results = (tmp_path / "results.md").read_text()
    assert "Seeds: canvas16 [0, 1]" in results
    changes = results.split("## Runs whose settings changed on the way")[1].split("##")[0]
    assert f"run in {changed} changed on the way (after step 2: optimizer.lr 0.016 → 0.01)" in (
        " ".join(changes.split())
    )
    assert changes.count("changed on the way") == 1
    assert "- `part 1`: settings canvas16, seeds 0, 1:" in results
    learned = _row(results, "| canvas16 | RSPC, λ=0.5 |")
    # occluded: +1 and +2 points against random; corruptions: -5 points both seeds
    assert "+1.50 ± 0.71 (SE 0.50; +1.00, +2.00)" in learned
    assert "-5.00 ± 0.00 (SE 0.00; -5.00, -5.00)" in learned
    header = results.split("## Against plain training")[1].split("\n\n")[2].splitlines()[0]
    assert "corruptions | mCE vs plain | worst case | clean" in header
    plain_rows = results.split("## Against plain training")[1]
    assert "+10.00 ± 0.00 (SE 0.00; +10.00, +10.00)" in _row(
        plain_rows, "| canvas16 | RSPC, random patches, λ=0.5 |"
    )  # corruptions: 60% against plain's 50%
    assert "-20.00 ± 0.00" in _row(plain_rows, "| canvas16 | RSPC, random patches, λ=0.5 |")


def test_attention16_adds_both_attention_selections_to_the_object16_runs():
    """The attention study shares `:payoff_object16`'s runs (and seeds), adds the two
    attention selections and the corruption suite; its validation tries only random_attended's
    pool, on the held-out training digits."""
    _, config = load_config(REPO / "configs" / "demo_study.py", "attention16")
    _, validation = load_config(REPO / "configs" / "demo_study.py", "attention16_validation")
    _, earlier = load_config(REPO / "configs" / "demo_study.py", "payoff_object16")
    study_runner.check(config)
    study_runner.check(validation)
    assert config.study.seeds == earlier.study.seeds and len(config.study.seeds) >= 16
    assert {"adaptive_occlusion", "corrupted_local"} <= set(config.evaluation.suites.split(","))
    for name, spec in config.study.settings.items():
        added = set(spec.methods) - set(earlier.study.settings[name].methods)
        assert added == {
            "attended_patches lam=0.5",
            "random_attended_patches lam=0.5 attended_pool=4.0",  # the validation's choice
        }
        run = study_runner.run_config(config, name, "attended_patches lam=0.5", seed=0)
        assert (run.rspc.selection, run.rspc.lam) == ("attended", 0.5)
        pools = [
            study_runner.run_config(validation, name, m, seed=0).rspc.attended_pool
            for m in validation.study.settings[name].methods
        ]
        assert len(pools) > 1 and all(p >= 1 for p in pools)
    assert validation.eval_split == "train[1200:]" and "test" not in validation.eval_split


def test_the_report_pairs_the_attention_selections_with_random_digit_and_content_c_runs():
    content = "rspc lam=0.5 corruption_model=content temperature=1.0"
    rows = {
        content: [{"greedy, 1 patch": 0.30}],
        "random_patches lam=0.5": [{"greedy, 1 patch": 0.20}],
        "random_object_patches lam=0.5": [{"greedy, 1 patch": 0.25}],
        "random_attended_patches lam=0.5 attended_pool=3.0": [{"greedy, 1 patch": 0.26}],
    }
    expected = {"random_patches": 0.06, "random_object_patches": 0.01, "content": -0.04}
    for partner, difference in expected.items():
        ((method, differences),) = study_runner.attention_against(rows, partner)
        assert method.startswith("random_attended_patches")
        assert differences == {"greedy, 1 patch": [pytest.approx(difference)]}
    assert [m for m, _ in study_runner.learned_vs_random(rows)] == [content]  # only C


def test_a_run_s_row_gives_its_training_masks_share_on_the_object():
    log = [{"train/loss": 1.0}] + [{"train/selection_on_object": v} for v in (0.5, 0.7, 0.9)]
    record = dict(
        results=dict(
            clean=dict(top1=0.9), patch_occlusion=dict(random_mask_accuracy=dict(mean=0.8, min=0.1))
        ),
        train_log=log,
    )
    row = study_runner.summarise(record)
    assert row["on object, training"] == pytest.approx(0.7) and row["on object, last log"] == 0.9


def test_a_run_stopped_by_a_signal_stops_the_study_unrecorded(tmp_path, monkeypatch):
    """SIGTERM or Ctrl-C ends training at a saved step; the study must neither evaluate nor
    record that run as finished (a rerun resumes it), nor go on to the next run."""
    from rspc_jax import ReportedError
    from rspc_jax.evaluation import run_suites
    from rspc_jax.training import loop

    stopped = dict(state=None, step=120, total_steps=270)
    monkeypatch.setattr(loop, "train_and_evaluate", lambda *a, **k: stopped)
    evaluated = []
    monkeypatch.setattr(run_suites, "run_suites", lambda *a, **k: evaluated.append(1) or {})
    with pytest.raises(ReportedError, match="step 120 of 270"):
        study_runner.run_one(_smoke_config(str(tmp_path)), str(tmp_path / "run"))
    assert not evaluated and not (tmp_path / "run" / "study_run.json").exists()
