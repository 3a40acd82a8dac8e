"""benchmarks.tpu_recipes: XLA:CPU's micro-batch per chip memory, then one TPU compile per
(config, slice) at it; finished searches and cells are kept and never compiled again for the
same config. The compilers are stand-ins here (tests/test_tpu_compile.py compiles for real)."""

import json

import pytest

from benchmarks import tpu_recipes
from rspc_jax.tools import memory_plan, tpu_compile

GiB = 2**30
DEMO = "configs/demo.py"


@pytest.fixture
def compilers(monkeypatch):
    """XLA:CPU: 1 GiB + 0.1 GiB an image. The TPU compiler: per slice, one that fits (v5e-8),
    one over the budget but within HBM (v4-8) and one it refuses (v4-32). Both count calls."""
    calls = {"xla_cpu": [], "tpu": []}
    tpu_gib = {"v5e-8": 6.9, "v4-8": 30.0, "v4-32": 40.0}

    def step_bytes(config, batch, variant, remat):
        calls["xla_cpu"].append(batch)
        return int((1 + 0.1 * batch) * GiB)

    def train_step(config, name, batch, headroom):
        calls["tpu"].append((name, batch))
        size = int(tpu_gib[name] * GiB)
        hbm = tpu_compile.SLICES[name].hbm
        refusal = "RESOURCE_EXHAUSTED: Ran out of memory" if size > hbm else ""
        return tpu_compile.Compiled(not refusal and size <= headroom * hbm, size, 60.0, refusal)

    monkeypatch.setattr(memory_plan, "step_bytes", step_bytes)
    monkeypatch.setattr(tpu_compile, "train_step", train_step)
    return calls


def test_one_search_per_chip_memory_and_one_compile_per_cell(compilers, tmp_path, capsys):
    results = tpu_recipes.Results(str(tmp_path / "r.json"))
    rows = tpu_recipes.run([DEMO], ["v5e-8", "v4-8", "v4-32"], results, 0.9)
    # 0.9 x 16 GiB = 14.4: 1 + 0.1 b <= 14.4 -> b <= 134 -> 128; 0.9 x 32 = 28.8 -> 272.
    assert [r[3]["micro"] for r in rows] == [128, 272, 272]
    # v4-8 and v4-32 share their search: no XLA:CPU batch compiled twice.
    assert len(compilers["xla_cpu"]) == len(set(compilers["xla_cpu"]))
    assert compilers["tpu"] == [("v5e-8", 128), ("v4-8", 272), ("v4-32", 272)]
    fits, over, refused = (r[3] for r in rows)
    assert fits["fits"] and not fits["refused"]
    assert fits["xla_cpu_bytes"] == int(13.8 * GiB) and fits["tpu_bytes"] == int(6.9 * GiB)
    assert not over["fits"] and not over["refused"]
    assert refused["refused"] and not refused["fits"]
    tpu_recipes.print_table(rows, 0.9)
    table = capsys.readouterr().out
    assert "| 128 (13.80) | fits (6.90) | 2.00 | 1.0 min |" in table
    assert "| 272 (28.20) | over budget (30.00) | 0.94 |" in table
    assert "| 272 (28.20) | refused (40.00) | 0.70 |" in table
    tpu_recipes.print_estimates(results, [DEMO])
    assert f"XLA:CPU estimates of {DEMO}: 6 compiles" in capsys.readouterr().out


def test_a_rerun_compiles_nothing_it_has_and_a_changed_config_everything(
    compilers, tmp_path, monkeypatch
):
    path = tmp_path / "r.json"
    first = tpu_recipes.run([DEMO], ["v5e-8"], tpu_recipes.Results(str(path)), 0.9)
    searched, compiled = len(compilers["xla_cpu"]), len(compilers["tpu"])
    again = tpu_recipes.run([DEMO], ["v5e-8", "v4-8"], tpu_recipes.Results(str(path)), 0.9)
    assert again[0][3] == first[0][3]
    assert compilers["tpu"][compiled:] == [("v4-8", 272)]  # only the new cell
    assert len(compilers["xla_cpu"]) > searched  # the new chip memory's search
    kept = json.loads(path.read_text())
    assert set(kept["cells"]) == {f"{DEMO}@v5e-8", f"{DEMO}@v4-8"}
    # Another config under the same name (here: a changed file) is measured afresh.
    real = tpu_recipes.load_config

    def changed(name):
        config = real(name)
        config.image_size = 2 * config.image_size
        return config

    monkeypatch.setattr(tpu_recipes, "load_config", changed)
    compiled = len(compilers["tpu"])
    tpu_recipes.run([DEMO], ["v5e-8"], tpu_recipes.Results(str(path)), 0.9)
    assert compilers["tpu"][compiled:] == [("v5e-8", 128)]
