"""The memory planner: XLA's estimate of the step grows with the batch, the search returns the
largest multiple of 8 that fits a budget (and the next does not), the accumulation plan
multiplies back to the global batch, and `python -m rspc_jax.plan` prints the table (where
remat fits more) or refuses an unknown slice or variant before compiling anything."""

import re

import pytest

from rspc_jax import ConfigError
from rspc_jax.tools import memory_plan
from tests.conftest import run_module_without_tensorflow, run_python, smoke_config

GiB = memory_plan.GiB


class Counted:
    """An estimate that counts its calls (each a compile when it is the real one)."""

    def __init__(self, estimate):
        self.estimate, self.calls = estimate, []

    def __call__(self, batch):
        self.calls.append(batch)
        return self.estimate(batch)


def _curved(batch):
    """A stand-in for XLA's estimate: affine in the batch plus a little curvature."""
    return 3 * GiB + 250 * 2**20 * batch + 2**20 * batch * batch // 4


def test_step_estimate_grows_with_the_batch_and_rspc_costs_more(tmp_path):
    config = smoke_config(str(tmp_path))
    plain_8, plain_16 = (memory_plan.step_bytes(config, b, "plain") for b in (8, 16))
    rspc_8 = memory_plan.step_bytes(config, 8, "rspc")
    assert 0 < plain_8 < plain_16
    assert rspc_8 > plain_8  # RSPC puts twice the images through the model


def test_search_returns_the_largest_batch_within_the_budget_of_the_compiled_step(tmp_path):
    config = smoke_config(str(tmp_path))
    estimate = Counted(lambda batch: memory_plan.step_bytes(config, batch, "plain"))
    at_16, at_24 = (
        memory_plan.step_bytes(config, 16, "plain"),
        memory_plan.step_bytes(config, 24, "plain"),
    )
    budget = (at_16 + at_24) / 2
    fit = memory_plan.largest_batch(estimate, budget, {})
    assert fit == memory_plan.Fit(16, at_16, True)
    assert 24 in estimate.calls  # the next multiple was compiled and found too large
    assert len(estimate.calls) <= 2 + 5


@pytest.mark.parametrize("budget_gib", [3.3, 10, 14.4, 28.8, 72, 85.5])
def test_search_agrees_with_brute_force_in_few_estimates(budget_gib):
    budget = budget_gib * GiB
    expected = max((b for b in range(8, 2000, 8) if _curved(b) <= budget), default=0)
    estimate = Counted(_curved)
    fit = memory_plan.largest_batch(estimate, budget, {})
    assert fit.batch == expected and fit.proven
    assert len(estimate.calls) <= 2 + 5
    if expected:
        assert fit.bytes == _curved(expected) and expected + 8 in estimate.calls
    else:
        assert fit.bytes == _curved(8)


def test_searches_share_their_estimates_and_stop_at_the_compile_limit():
    measured = {}
    estimate = Counted(_curved)
    memory_plan.largest_batch(estimate, 14.4 * GiB, measured)
    first = len(estimate.calls)
    memory_plan.largest_batch(estimate, 14.4 * GiB, measured)
    assert len(estimate.calls) == first  # the same budget again costs nothing
    fit = memory_plan.largest_batch(Counted(_curved), 72 * GiB, {}, max_compiles=0)
    assert not fit.proven and fit.batch == 64 and fit.bytes <= 72 * GiB


@pytest.mark.parametrize(
    "global_batch, devices, micro, expected",
    [
        (2048, 8, 56, (32, 8)),  # the largest divisor of 256 up to 56
        (2048, 1, 300, (256, 8)),
        (4096, 4, 1000, (512, 2)),
        (2048, 8, 512, (256, 1)),  # the whole per-device batch fits: no accumulation
        (384, 4, 40, (32, 3)),
        (100, 8, 16, None),  # 8 devices cannot split 100 images evenly
        (2048, 8, 0, None),  # nothing fits
    ],
)
def test_accumulation_reaches_the_global_batch_exactly(global_batch, devices, micro, expected):
    plan = memory_plan.accumulation(global_batch, devices, micro)
    assert plan == expected
    if plan:
        used, steps = plan
        assert devices * used * steps == global_batch and used <= micro


def test_plan_covers_every_step_and_slice_and_shares_a_search_between_equal_memories(tmp_path):
    config = smoke_config(str(tmp_path), batch_size=2048)
    calls = []

    def estimate(config, batch, variant, remat):
        calls.append((variant, remat, batch))
        return _curved(batch) * (2 if variant == "rspc" else 1) // (2 if remat else 1)

    slices = memory_plan.resolve_slices("v3-8,v5e-8,v4-8,h100")
    rows = memory_plan.plan(config, ["plain", "rspc"], slices, 0.9, estimate)
    assert [(r.variant, r.remat, r.slice) for r in rows] == [
        (v, m, s) for v in ("plain", "rspc") for m in (False, True) for s in slices
    ]
    for r in rows:
        budget = 0.9 * r.device_bytes
        cost = [estimate(config, b, r.variant, r.remat) for b in (r.fit.batch, r.fit.batch + 8)]
        assert cost[0] <= budget < cost[1]
        used, steps = r.accumulation
        assert r.devices * used * steps == 2048 and used <= r.fit.batch
    by_slice = {(r.variant, r.remat, r.slice): r.fit for r in rows}
    assert by_slice["rspc", False, "v3-8"] == by_slice["rspc", False, "v5e-8"]
    assert by_slice["rspc", False, "v3-8"].batch < by_slice["rspc", False, "v4-8"].batch


def test_unknown_slice_is_a_config_error_before_anything_compiles(tmp_path):
    def estimate(*args):
        raise AssertionError("compiled before the slices were checked")

    with pytest.raises(ConfigError, match=r"unknown slice 'tpu9'.*v3-8 \(8 x 16 GiB\).*h100"):
        memory_plan.print_plan(smoke_config(str(tmp_path)), ["plain"], "v4-8,tpu9", 0.9, estimate)
    with pytest.raises(ConfigError, match="headroom"):
        memory_plan.print_plan(smoke_config(str(tmp_path)), ["plain"], "v4-8", 1.5, estimate)


def test_variants_are_the_config_switched_to_each_step_and_unknown_ones_are_refused(tmp_path):
    config = smoke_config(str(tmp_path))
    assert not memory_plan.variant_config(config, "plain").rspc.enabled
    assert memory_plan.variant_config(config, "rspc").rspc.enabled
    trades = memory_plan.variant_config(config, "trades2")
    assert trades.adversarial.method == "trades" and not trades.rspc.enabled
    assert config.adversarial.method != "trades"  # a copy: the config itself is unchanged
    with pytest.raises(ConfigError, match="unknown step variant 'plane'.*plain, rspc"):
        memory_plan.check_variants(["rspc", "plane"])


def test_cli_prints_the_plan_without_tensorflow_and_refuses_an_unknown_slice():
    args = ["--config=configs/demo.py:smoke"]
    bad = run_python(["-m", "rspc_jax.plan", *args, "--slices=v4-8,tpu9"], timeout=120)
    message = " ".join(bad.stderr.split())
    assert bad.returncode == 1 and "Traceback" not in message
    assert re.search(r"error: unknown slice 'tpu9'; .* v5e-8 \(8 x 16 GiB\)", message)
    result = run_module_without_tensorflow(
        "rspc_jax.plan",
        [*args, "--variants=plain", "--slices=v4-8", "--compiler=xla_cpu"],
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = re.findall(
        r"^v4-8\s+4\s+32\s+plain\s+(off|on)\s+(\d+)\s+(\d+\.\d+)\s+16\s+(\d+)\s+(\d+) XLA:CPU$",
        result.stdout,
        re.M,
    )
    assert [r[0] for r in rows] == ["off", "on"], result.stdout
    for _, largest, gib, micro, steps in rows:
        assert int(largest) >= 16 and 0 < float(gib) <= 0.9 * 32
        assert 4 * int(micro) * int(steps) == 64  # the demo's global batch
    # Remat saves memory in the estimate only with memory_plan.XLA_FLAGS (XLA:CPU otherwise
    # merges the recomputation back into the forward pass).
    assert int(rows[1][1]) > 1.2 * int(rows[0][1])
