"""The speed laboratory (benchmarks/) runs at smoke size and its numbers agree with each
other: images/s is the batch over the median step, steps/s its inverse, each ratio the
quotient of two medians, RSPC's FLOPs at least twice the plain step's and the same for a
step written with loops; a variant's @CHOICE=VALUE changes what is traced and jitted;
reference steps speak a JSON-record protocol; bad input stops with a message naming the
fix, before anything compiles."""

import json
import os
import re
import statistics
import sys

import jax
import jax.numpy as jnp
import pytest

from benchmarks import measure, side_by_side, timing, variants
from rspc_jax import ConfigError, ReportedError
from rspc_jax.models import ops
from rspc_jax.training import host_memory
from tests.conftest import (
    REPO,
    load_config,
    run_module_without_tensorflow,
    run_python,
    skip_without,
    smoke_config,
)

_NUMBER = re.compile(r"^-?\d+(\.\d+)?(e[+-]?\d+)?$")


def _rows(out: str, width: int) -> dict[str, list[str]]:
    """The table rows of `out` with `width` fields, by their first field: numbers or n/a."""
    rows = {}
    for line in out.splitlines():
        fields = line.split()
        numeric = [f for f in fields[1:] if _NUMBER.match(f) or f in ("n/a",)]
        if len(fields) == width and len(numeric) >= width - 2:
            rows[fields[0]] = fields[1:]
    return rows


def _ratio_lines(out: str) -> dict[tuple[str, str, bool], float]:
    """(variant, baseline, over the rounds) -> the printed step-time ratio."""
    found = re.findall(r"^ratio (\S+)/(\S+) step time( over the rounds)?: (\S+)$", out, re.M)
    return {(a, b, bool(over)): float(value) for a, b, over, value in found}


def _quotient_of_printed(value, num, den, *, num_digits=None, den_digits=None) -> bool:
    """Whether the printed `value` can be num / den when num and den are themselves printed
    values rounded to that many decimals (None: exact), up to value's own rounding (1%):
    with millisecond steps, a median printed to 4 decimals is only known to a few percent."""
    num_half = 0.5 * 10.0**-num_digits if num_digits is not None else 0.0
    den_half = 0.5 * 10.0**-den_digits if den_digits is not None else 0.0
    low = (num - num_half) / (den + den_half)
    high = (num + num_half) / max(den - den_half, 1e-12)
    return low * 0.99 - 0.005 <= value <= high * 1.01 + 0.005


def _train_step(*args, timeout=600):
    return run_module_without_tensorflow(
        "benchmarks.train_step", ["--config=configs/demo.py:smoke", *args], timeout=timeout
    )


def test_the_table_and_the_interleaved_rounds_agree_with_their_own_medians():
    """One run of three variants, then two interleaved rounds, without TensorFlow (the
    benchmark needs no input pipeline)."""
    result = _train_step(
        "--batch=8", "--steps=2", "--variants=plain,plain_2x,rspc", "--interleave", "--rounds=2"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    table, first_part = _rows(out, 11), out.split("our variants alone")[0]
    assert set(_rows(first_part, 11)) == {"plain", "plain_2x", "rspc"}, out
    median = {name: float(row[1]) for name, row in table.items()}
    for name, batch in (("plain", 8), ("plain_2x", 16), ("rspc", 8)):
        compile_s, med, images, steps_s, against_first, gflop, mfu, _, _, busy = table[name]
        assert float(compile_s) > 0 and float(busy) > 0
        assert _quotient_of_printed(float(images), batch, float(med), den_digits=4)
        assert _quotient_of_printed(float(steps_s), 1, float(med), den_digits=4)
        assert _quotient_of_printed(
            float(against_first), median[name], median["plain"], num_digits=4, den_digits=4
        )
        assert mfu == "n/a"  # no known peak on CPU
    gflop = {name: float(row[5]) for name, row in table.items()}
    assert gflop["plain"] > 0 and gflop["rspc"] >= 1.9 * gflop["plain"]
    assert gflop["plain_2x"] == pytest.approx(2 * gflop["plain"], rel=0.1)
    ratios = _ratio_lines(out)
    for (name, base, over), value in ratios.items():
        if not over:
            assert _quotient_of_printed(
                value, median[name], median[base], num_digits=4, den_digits=4
            ), (name, base)
    rounds = _rows(out.split("our variants alone")[1], 6)
    assert set(rounds) == {"plain", "plain_2x", "rspc"}, out
    for name, (med, against, reference, _, _) in rounds.items():
        assert reference == "plain"
        plain = float(rounds["plain"][0])
        assert _quotient_of_printed(float(against), float(med), plain, num_digits=4, den_digits=4)
        if name != "plain":
            assert _quotient_of_printed(
                ratios[name, "plain", True], float(med), plain, num_digits=4, den_digits=4
            )
    spread = dict(re.findall(r"(\w+) (\d+\.\d+-\d+\.\d+)", out.split("single rounds")[1]))
    for name in ("plain_2x", "rspc"):
        low, high = (float(v) for v in spread[name].split("-"))
        assert 0 < low <= high


def test_a_step_with_loops_counts_the_flops_of_every_block_micro_batch_and_step(tmp_path):
    """XLA's cost analysis counts a loop body once; the scanned model, the accumulated step
    and a call of several steps do the same work per step as the plain one."""
    flops = []
    for overrides in ({}, {"scan_blocks": True}, {"grad_accum_steps": 2}, {"steps_per_call": 3}):
        config = smoke_config(str(tmp_path), batch_size=8, **overrides)
        flops.append(measure.compile_variants(config, ["plain"])["plain"]["flops"])
    assert flops[0] > 0 and flops == [flops[0]] * 4, flops


def test_compile_only_runs_no_step_and_fills_the_compilation_cache(tmp_path):
    """On CPU with the cache on, the steps take products the cache can store
    (`ops.compiler_options`), so a later timed run loads them."""
    cache = tmp_path / "cache"
    result = run_python(
        [
            "-m",
            "benchmarks.train_step",
            "--config=configs/demo.py:smoke",
            "--batch=8",
            "--variants=plain",
            "--compile_only",
        ],
        env_extra={"JAX_COMPILATION_CACHE_DIR": str(cache)},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (compile_s, gflop, xla_mib) = _rows(result.stdout, 4)["plain"]
    assert float(compile_s) > 0 and float(gflop) > 0 and float(xla_mib) > 0
    assert "median" not in result.stdout  # nothing was timed
    assert any(cache.iterdir()), "nothing was written to the compilation cache"


def _fake_reference(record: dict) -> list[str]:
    return [sys.executable, "-c", f"import json; print('log line'); print(json.dumps({record!r}))"]


def _fake_variant(times: list[float]) -> dict:
    """A timed variant whose calls take `times` in turn (a warm-up and one timed call per
    round)."""
    calls = iter(times)
    return {"time_steps": lambda count: ([next(calls)] * count, 1.5)}


def test_side_by_side_pairs_each_variant_with_its_reference_by_the_json_protocol(
    monkeypatch, capsys
):
    """Each round runs the reference's command afresh (its last line a JSON record) and our
    steps after a warm-up, from released memory; the ratios are quotients of the medians
    over all rounds, the spread that of single rounds."""
    events = []
    monkeypatch.setattr(host_memory, "release_freed_memory", lambda: events.append("release"))
    record = {"times": [0.2, 0.2], "framework": "Fake 1.0", "cores_busy": 2.0}
    results = {"plain": _fake_variant([0.1, 0.1, 0.3, 0.3]), "rspc": _fake_variant([0.4] * 4)}
    references = {"plain": ("ref:plain", _fake_reference(record))}
    rows = side_by_side.compare_side_by_side(results, references, steps=1, rounds=2)
    assert events == ["release"]
    assert rows["ref:plain"] == dict(median_sec=0.2, against="ref:plain", ratio=1.0, spread=None)
    assert rows["plain"]["median_sec"] == pytest.approx(0.2)
    assert rows["plain"]["against"] == "ref:plain" and rows["plain"]["ratio"] == pytest.approx(1)
    assert rows["plain"]["spread"] == pytest.approx((0.5, 1.5))
    assert rows["rspc"]["against"] == "ref:plain"  # no reference of its own: the first
    assert rows["rspc"]["ratio"] == pytest.approx(2.0)
    out = capsys.readouterr().out
    assert "Fake 1.0" in out and "device MiB" not in out
    printed = _rows(out, 6)
    assert float(printed["rspc"][1]) == pytest.approx(2.0) and printed["rspc"][4] == "1.50"
    assert printed["ref:plain"][4] == "2.00"  # the record's cores busy
    device = _fake_reference({"times": [0.2], "peak_device_bytes": 3 * 2**20})
    side_by_side.compare_side_by_side(
        {"plain": _fake_variant([0.1, 0.1])}, {"plain": ("ref", device)}, steps=1, rounds=1
    )
    assert re.search(r"^ref\s.*\s3$", capsys.readouterr().out, re.M)  # the device column


def test_a_reference_that_fails_or_prints_no_record_is_reported_with_what_it_printed():
    with pytest.raises(ReportedError, match="'ref' failed: ValueError: boom"):
        side_by_side.run_reference("ref", [sys.executable, "-c", "raise ValueError('boom')"])
    with pytest.raises(ReportedError, match=r"JSON record with 'times'.*\['not json'\]"):
        side_by_side.run_reference("ref", [sys.executable, "-c", "print('not json')"])
    with pytest.raises(ReportedError, match=r"JSON record with 'times'"):
        side_by_side.run_reference("ref", _fake_reference({"seconds": [0.1]}))


def test_a_variant_s_choices_change_what_is_traced_and_jitted_in_its_block_only():
    """'rspc@batch_sum=xla@cpu_products=onednn': the RSPC step's config, traced with XLA's
    batch sum and jitted with oneDNN's products, and nothing else outside the block."""
    name = "rspc@batch_sum=xla@cpu_products=onednn"
    assert variants.choices_of(name) == {"batch_sum": "xla", "cpu_products": "onednn"}

    def program():
        grad = jax.grad(lambda x: jnp.sum(ops.broadcast_over_batch(x, 4) ** 2))
        return str(jax.make_jaxpr(grad)(jnp.ones(3))), ops.compiler_options() or {}

    default = program()
    with variants.implementations(name):
        chosen = program()
    assert chosen[0] != default[0]  # another sum over the batch
    assert chosen[1].get("xla_cpu_use_onednn") and not default[1].get("xla_cpu_use_onednn")
    assert program() == default
    config = smoke_config("unused")
    assert variants.variant_config(config, name).rspc.enabled
    doubled = variants.variant_config(config, "plain_2x@window_ops=xla")
    assert doubled.batch_size == 2 * config.batch_size and not doubled.rspc.enabled


@pytest.mark.parametrize(
    "names, message",
    [
        ("rspc,plane", "unknown step variant 'plane'.*plain, rspc, plain_2x"),
        ("rspc@cpu_products=fast", "cpu_products value 'fast' is not one of"),
        ("rspc@products=xla", "'products' is not an implementation choice.*cpu_products"),
        ("rspc@cpu_products", "write each choice as @CHOICE=VALUE"),
    ],
)
def test_unknown_variants_and_choices_are_refused_with_the_known_ones(names, message):
    with pytest.raises(ConfigError, match=message):
        variants.check_variants(names.split(","))


def test_the_cli_refuses_bad_input_in_one_paragraph_before_compiling():
    bad_choice = _train_step("--variants=plain,rspc@cpu_products=fast", timeout=120)
    assert bad_choice.returncode == 1 and "Traceback" not in bad_choice.stderr
    assert "cpu_products value 'fast' is not one of" in " ".join(bad_choice.stderr.split())
    unused = _train_step("--variants=plain", "--compare_command=rspc=true", timeout=120)
    assert unused.returncode != 0
    assert "write VARIANT=COMMAND with VARIANT one of --variants (plain)" in unused.stderr
    for result in (bad_choice, unused):
        assert "Compil" not in result.stderr


def test_timm_reference_mixes_as_the_config_does_and_prints_the_record():
    """The timm step (benchmarks.timm_step) does the Mixup/CutMix our step does, at our
    precision and on our device, and prints the protocol's record; an odd batch cannot be
    mixed in pairs and is refused before anything compiles."""
    _, config = load_config(REPO / "configs" / "deit_s.py")
    command = side_by_side.timm_command(config, steps=2)
    assert {"--mixup_alpha=0.8", "--cutmix_alpha=1.0", "--device=cpu"} <= set(command)
    config.batch_size = 7
    with pytest.raises(ConfigError, match=r"needs an even batch \(got 7\)"):
        side_by_side.timm_command(config, steps=1)
    skip_without("timm")
    tiny = ["--model=deit_tiny_patch16_224", "--image_size=32", "--batch=2", "--steps=2"]
    result = run_python(["-m", "benchmarks.timm_step", *tiny, "--mixup_alpha=0.8"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert record["mixup"] is True and len(record["times"]) == 2
    assert record["median_sec"] == statistics.median(record["times"]) > 0


def test_layer_benchmark_ratios_are_the_quotients_of_its_medians():
    skip_without("timm")
    parts = ["--batch=2", "--tokens=17", "--width=64", "--heads=2", "--model="]
    result = run_python(["-m", "benchmarks.layers", *parts, "--steps=2", "--rounds=2"])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _rows(result.stdout, 4)
    assert set(rows) == {"layernorm", "attention", "mlp", "block"}, result.stdout
    for ours, theirs, ratio in ([float(v) for v in row] for row in rows.values()):
        assert ours > 0 and theirs > 0
        assert ratio == pytest.approx(ours / theirs, abs=0.01, rel=0.01)


def test_peak_flops_by_device_kind_and_the_host_s_count_of_a_lowered_step():
    assert measure.peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4e12
    assert measure.peak_flops("TPU v4", "bfloat16") == 275e12
    assert measure.peak_flops("TPU v3", "float32") is None
    assert measure.peak_flops("cpu", "bfloat16") is None
    lowered = jax.jit(lambda a, b: jnp.tanh(a @ b).sum()).lower(
        jnp.ones((64, 32)), jnp.ones((32, 16))
    )
    assert measure.host_cost_analysis(lowered)["flops"] == lowered.cost_analysis()["flops"]


def test_pytorch_references_use_the_cores_the_process_may_run_on():
    """Under `taskset -c 0` PyTorch gets one thread, not one per core of the machine."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("this platform has no CPU affinity masks")
    script = (
        "import os; from benchmarks import timing; "
        "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); print(timing.usable_cores())"
    )
    result = run_python(["-c", script], timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["1"]
    assert timing.usable_cores() >= 1
