"""config.sharding='fsdp' on 8 simulated CPU devices (a subprocess each: XLA_FLAGS must be
set before JAX starts): the same steps as replicated, a sharded layout, and resume across
sharding modes and device counts."""

import json
import math
import textwrap

import jax
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from rspc_jax import parallel
from tests.conftest import run_python

# A ViT wide enough that its MLP kernels (64 x 256) reach parallel.FSDP_MIN_SIZE; without
# drop path, so that the modes differ by their collectives alone.
_WIDE = {"model.width": 64, "model.drop_path_rate": 0.0}


def test_fsdp_specs_split_the_largest_divisible_axis_of_big_arrays():
    shapes = {
        "qkv": ((768, 2304), P(None, "data")),
        "fc2": ((3072, 768), P("data")),
        "square": ((256, 256), P(None, "data")),  # ties: the last axis, as big_vision
        "largest_not_divisible": ((1001, 64), P(None, "data")),
        "none_divisible": ((1001, 65), P()),
        "at_threshold": ((parallel.FSDP_MIN_SIZE,), P("data")),
        "below_threshold": ((parallel.FSDP_MIN_SIZE - 8,), P()),
        "bias": ((768,), P()),
        "count": ((), P()),
    }
    tree = {k: jax.ShapeDtypeStruct(shape, np.float32) for k, (shape, _) in shapes.items()}
    assert parallel.fsdp_specs(tree, 8) == {k: spec for k, (_, spec) in shapes.items()}
    assert parallel.fsdp_specs(tree, 1) == {k: P() for k in shapes}
    for spec, axis in ((P(), None), (P("data"), 0), (P(None, None, "data"), 2)):
        assert parallel.sharded_axis(spec) == axis


_EQUALITY_SCRIPT = textwrap.dedent("""
    import itertools, json, sys
    import jax, numpy as np
    from rspc_jax import parallel
    from rspc_jax.data import specs as datasets
    from rspc_jax.data import train as train_data
    from rspc_jax.training import setup
    from tests.conftest import smoke_config

    assert jax.device_count() == 8, jax.devices()
    config = smoke_config(sys.argv[1], batch_size=16, ema_decay=0.9,
                          **{"rspc.enabled": sys.argv[2] == "rspc", **json.loads(sys.argv[3])})
    spec = datasets.dataset_spec(config.dataset)
    model = setup.build_model(config, spec.num_classes)
    batches = list(itertools.islice(train_data.train_iterator(
        dataset=config.dataset, data_dir=config.data_dir, split="train", image_size=32,
        local_batch_size=16, seed=0, augment="digits"), 3))
    mesh = parallel.create_mesh()
    results = {}
    # FSDP also with the three steps in one call (config.steps_per_call).
    for sharding, per_call in (("replicated", 1), ("fsdp", 1), ("fsdp", 3)):
        config.sharding, config.steps_per_call = sharding, per_call
        parts = setup.build(config, model, spec, mesh, steps_per_epoch=20, total_steps=20)
        state = parts.init(jax.random.PRNGKey(0))
        specs = [x.sharding.spec for x in jax.tree.leaves(state.params)]
        if per_call > 1:
            state, metrics = parts.train_steps(
                state, tuple(parallel.to_global(batch, mesh) for batch in batches))
            metrics = jax.tree.map(lambda m: m[-1], jax.block_until_ready(metrics))
        for batch in batches if per_call == 1 else ():
            state, metrics = parts.train_step(state, parallel.to_global(batch, mesh))
            jax.block_until_ready(metrics)  # queued collectives deadlock on 2 CPU cores
        # The step hands the state back in the layout it got it in.
        assert [x.sharding.spec for x in jax.tree.leaves(state.params)] == specs
        results[sharding, per_call] = jax.device_get((state, metrics)), specs
    replicated, _ = results["replicated", 1]
    for mode in (("fsdp", 1), ("fsdp", 3)):
        fsdp, fsdp_specs = results[mode]
        assert sum(parallel.DATA_AXIS in spec for spec in fsdp_specs) >= 4, fsdp_specs
        for name in ("params", "ema_params", "opt_state", "corruption_params",
                     "corruption_opt_state", "batch_stats", "step"):
            a, b = getattr(replicated[0], name), getattr(fsdp[0], name)
            assert jax.tree.structure(a) == jax.tree.structure(b), (mode, name)
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
                np.testing.assert_allclose(x, y, atol=1e-5, rtol=0, err_msg=f"{mode} {name}")
        assert replicated[1].keys() == fsdp[1].keys()
        for key in replicated[1]:
            np.testing.assert_allclose(
                replicated[1][key], fsdp[1][key], rtol=1e-4, atol=1e-6, err_msg=f"{mode} {key}")
    print("EQUAL")
""")


@pytest.mark.parametrize("variant", ["rspc", "plain"])
def test_fsdp_steps_equal_replicated_steps_on_eight_devices(digits_data_dir, variant):
    result = run_python(
        ["-c", _EQUALITY_SCRIPT, digits_data_dir, variant, json.dumps(_WIDE)],
        devices=8,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "EQUAL" in result.stdout


_LAYOUT_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import jax, numpy as np
    from jax.sharding import PartitionSpec as P
    from rspc_jax import parallel
    from rspc_jax.data import specs as datasets
    from rspc_jax.interop import state_dicts
    from rspc_jax.training import loop, setup
    from tests.conftest import smoke_config

    config = smoke_config(sys.argv[1], ema_decay=0.9, sharding="fsdp", **json.loads(sys.argv[2]))
    spec = datasets.dataset_spec(config.dataset)
    model = setup.build_model(config, spec.num_classes)
    mesh = parallel.create_mesh()
    parts = setup.build(config, model, spec, mesh, steps_per_epoch=20, total_steps=20)
    state = parts.init(jax.random.PRNGKey(0))
    adam = state.opt_state[0]  # optax.adamw: ScaleByAdamState first
    kernel = ("blocks_0", "mlp", "fc1", "kernel")

    def at(tree, path):
        for key in path:
            tree = tree[key]
        return tree

    for x in (at(state.params, kernel), at(adam.mu, kernel), at(adam.nu, kernel),
              at(state.ema_params, kernel)):
        assert x.shape == (64, 256), x.shape
        assert x.sharding.spec == P(None, "data"), x.sharding.spec
        assert x.addressable_shards[0].data.shape == (64, 32), x.addressable_shards[0].data.shape
    small = [state.step, adam.count, state.rng, at(state.params, ("blocks_0", "mlp", "fc1", "bias")),
             *jax.tree.leaves(state.corruption_params), *jax.tree.leaves(state.batch_stats)]
    for x in small:
        assert x.sharding.is_fully_replicated, (x.shape, x.sharding)
        assert x.addressable_shards[0].data.shape == x.shape
    # config.init_from loads whole arrays into the same layout (and the EMA with them).
    start = os.path.join(sys.argv[3], "start.safetensors")
    other = parts.init(jax.random.PRNGKey(1))
    state_dicts.save_safetensors(start, state_dicts.export_state_dict(
        dict(params=other.params, batch_stats=other.batch_stats)))
    config.init_from = start
    loaded = loop.initialize_from_checkpoint(config, state, mesh)
    for x, y, ema, before in zip(*(jax.tree.leaves(t) for t in (
            loaded.params, other.params, loaded.ema_params, state.params))):
        assert x.sharding == ema.sharding == before.sharding, (x.sharding, before.sharding)
        np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(ema, y)
    print("LAYOUT")
""")


def test_fsdp_shards_big_arrays_over_the_data_axis_and_replicates_the_rest(
    digits_data_dir, tmp_path
):
    result = run_python(
        ["-c", _LAYOUT_SCRIPT, digits_data_dir, json.dumps(_WIDE), str(tmp_path)],
        devices=8,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "LAYOUT" in result.stdout


_RESUME_SCRIPT = textwrap.dedent("""
    import json, math, os, sys
    import jax, numpy as np
    from rspc_jax.interop import checkpoints
    from rspc_jax.training import loop
    from tests.conftest import smoke_config

    data_dir, workdir, runs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    for sharding, stop_at in runs:  # one run of 6 steps, stopped and resumed
        config = smoke_config(data_dir, sharding=sharding, total_steps=6, eval_every_steps=2,
                              ema_decay=0.9, keep_best="accuracy", **{"rspc.enabled": False},
                              **json.loads(sys.argv[4]))
        steps = []
        result = loop.train_and_evaluate(
            config, workdir, should_stop=lambda s: steps.append(s) or s >= stop_at)
        kernel = result["state"].params["blocks_0"]["mlp"]["fc1"]["kernel"]
        _, saved, _ = checkpoints.read_saved_state(os.path.join(workdir, "checkpoints"))
        np.testing.assert_array_equal(saved["params"]["blocks_0"]["mlp"]["fc1"]["kernel"], kernel)
        assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(result["state"])))
        assert math.isfinite(result["eval"]["loss"]) and math.isfinite(result["eval_ema"]["loss"])
        print("RUN", json.dumps(dict(
            devices=jax.device_count(), sharding=sharding, steps=steps, step=result["step"],
            shards=len(kernel.addressable_shards), shard_shape=kernel.addressable_shards[0].data.shape)))
""")


def _runs(output: str) -> list[dict]:
    return [json.loads(line[4:]) for line in output.splitlines() if line.startswith("RUN ")]


def test_a_run_resumes_across_sharding_modes_and_device_counts(digits_data_dir, tmp_path):
    """Replicated on 8 devices -> FSDP on 8 -> replicated on 1, in one workdir through the
    real loop: each run continues from the last one's checkpoint in its own layout (plain
    training: the corruption model is replicated in every mode, and RSPC's step costs compile
    time here that the equality test spends already)."""
    workdir = str(tmp_path / "run")

    def run(devices, runs):
        result = run_python(
            ["-c", _RESUME_SCRIPT, digits_data_dir, workdir, json.dumps(runs), json.dumps(_WIDE)],
            devices=devices,
            timeout=400,
        )
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        return _runs(result.stdout)

    eight = run(8, [["replicated", 2], ["fsdp", 4]])
    one = run(1, [["replicated", 6]])
    assert [(r["devices"], r["sharding"], r["steps"], r["step"]) for r in eight + one] == [
        (8, "replicated", [1, 2], 2),
        (8, "fsdp", [3, 4], 4),
        (1, "replicated", [5, 6], 6),
    ]
    # The FSDP run's kernel was sharded 8 ways; the others hold it whole on each device.
    assert [(r["shards"], r["shard_shape"]) for r in eight + one] == [
        (8, [64, 256]),
        (8, [64, 32]),
        (1, [64, 256]),
    ]
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    # One record per logged step: each run continued the log where the last one stopped.
    train_steps = [r["step"] for r in records if "train/loss" in r]
    assert train_steps == sorted(set(train_steps)) and train_steps[-1] == 6, train_steps
    assert all(math.isfinite(v) for r in records for v in r.values() if isinstance(v, float))
