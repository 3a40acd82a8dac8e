"""configs/demo_study.py:smoke through rspc_jax.study: both runs trained and evaluated,
results.md with every metric for both methods, the figures, and a resumed study that
trains nothing again."""

import importlib.util
import json

from rspc_jax.tools import study as study_runner
from tests.conftest import REPO


def _smoke_config(data_dir):
    spec = importlib.util.spec_from_file_location("demo_study", REPO / "configs" / "demo_study.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("smoke")
    config.data_dir = data_dir
    return config


def test_smoke_study_writes_results_and_figures(digits_data_dir, tmp_path):
    config = _smoke_config(digits_data_dir)
    path = study_runner.run_study(config, str(tmp_path), command="smoke")
    results = (tmp_path / "results.md").read_text()
    assert path == str(tmp_path / "results.md")
    for metric in (
        "clean accuracy",
        "occluded accuracy, mean over masks",
        "occluded accuracy, worst mask",
        "attention Cos-Sim, mean",
        "attention Cos-Sim, block 1",
        "corrupted accuracy, noise",
        "corrupted accuracy, weather",
        "corrupted accuracy, mean",
        "PGD accuracy",
    ):
        row = next(line for line in results.splitlines() if line.startswith(f"| {metric} |"))
        assert "—" not in row, row
    assert "| plain (no RSPC) | RSPC |" in results
    assert "- occluded accuracy, mean over masks: " in results
    for name in (
        "occlusion_boxplots.png",
        "cos_sim_histograms.png",
        "clean_attention_maps_0.png",
        "rspc_attention_maps_0.png",
        "rspc_learned_masks.png",
    ):
        assert (tmp_path / "figures" / name).stat().st_size > 0, name
        assert f"figures/{name}" in results
    record = json.loads((tmp_path / "runs" / "rspc_s0" / "study_run.json").read_text())
    assert record["results"]["adversarial"]["accuracy"].keys() == {"clean", "pgd"}
    assert record["results"]["patch_occlusion"]["occluded_patches"] == 2
    # A second invocation finds every run finished and only rewrites the results.
    (tmp_path / "runs" / "clean_s0" / "checkpoints").rename(tmp_path / "moved")
    study_runner.run_study(config, str(tmp_path), command="smoke")
    assert not (tmp_path / "runs" / "clean_s0" / "checkpoints").exists()
