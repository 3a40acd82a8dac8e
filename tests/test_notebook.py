"""notebooks/rspc_colab.ipynb executed end to end in smoke mode (a few training steps of the
2-block demo, small evaluation settings) in a Jupyter kernel, as a user would run it."""

import os

import nbclient
import nbformat
import pytest
from safetensors.numpy import load_file

from tests.conftest import REPO

NOTEBOOK = REPO / "notebooks" / "rspc_colab.ipynb"
FIGURES = (
    "occlusion_boxplot.png",
    "learned_masks.png",
    "cos_sim_histogram.png",
    "attention_maps_0.png",
    "attention_maps_1.png",
)


@pytest.fixture(scope="module")
def executed(digits_data_dir, tmp_path_factory):
    """(executed notebook, its working directory)."""
    cwd = tmp_path_factory.mktemp("notebook")
    pythonpath = filter(None, [str(REPO), os.environ.get("PYTHONPATH")])
    env = dict(
        os.environ,
        RSPC_NOTEBOOK_SMOKE="1",
        RSPC_NOTEBOOK_DATA_DIR=digits_data_dir,
        RSPC_NOTEBOOK_REPO_DIR=str(REPO),
        PYTHONPATH=os.pathsep.join(pythonpath),
    )
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # Kernel python3 runs this interpreter (jupyter_client substitutes sys.executable).
    nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
    ).execute(env=env)
    return nb, cwd


def _cell(nb, cell_id: str):
    return next(c for c in nb.cells if c.get("id") == cell_id)


def _images(cell) -> int:
    return sum("image/png" in out.get("data", {}) for out in cell.outputs)


def test_committed_notebook_is_valid_and_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert "parameters" in _cell(nb, "parameters").metadata.get("tags", [])
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, cell.id


def test_training_metrics_are_plotted(executed):
    nb, cwd = executed
    assert (cwd / "runs" / "demo" / "metrics.jsonl").stat().st_size > 0
    assert _images(_cell(nb, "metrics")) == 1


def test_evaluation_figures_are_written_and_shown(executed):
    nb, cwd = executed
    figures = cwd / "runs" / "demo" / "eval" / "figures"
    for name in FIGURES:
        assert (figures / name).stat().st_size > 0, name
    # The box plot, the histogram and two attention maps; then the corruption model's masks.
    assert _images(_cell(nb, "figures")) == 4
    assert _images(_cell(nb, "masks")) == 1


def test_exported_safetensors_load(executed):
    nb, cwd = executed
    weights = load_file(cwd / "runs" / "demo" / "vit_demo.safetensors")
    assert weights and all(w.size for w in weights.values())
    printed = "".join(out.get("text", "") for out in _cell(nb, "export").outputs)
    assert f"{len(weights)} tensors" in printed
