"""8 simulated CPU devices (a subprocess each: XLA_FLAGS must be set before JAX starts)."""

import textwrap

from tests.conftest import run_python

_EQUALITY_SCRIPT = textwrap.dedent("""
    import itertools, sys
    import jax, numpy as np
    from jax.sharding import Mesh
    from rspc_jax import parallel, rspc
    from rspc_jax.data import specs as datasets
    from rspc_jax.data import train as train_data
    from rspc_jax.training import setup
    from tests.conftest import smoke_config

    assert jax.device_count() == 8, jax.devices()
    # Drop-path masks are drawn per device, so they are off for the comparison.
    config = smoke_config(sys.argv[1], batch_size=16, **{"model.drop_path_rate": 0.0})
    spec = datasets.dataset_spec(config.dataset)
    model = setup.build_model(config, spec.num_classes)
    batches = list(itertools.islice(train_data.train_iterator(
        dataset=config.dataset, data_dir=config.data_dir, split="train", image_size=32,
        local_batch_size=16, seed=0, augment="digits", random_erase_prob=0.5), 3))
    # Erasing's noise is drawn on the devices, per image: it must not depend on the split.
    assert any((b["erase_box"][:, 2] * b["erase_box"][:, 3] > 0).any() for b in batches)
    results = {}
    # 8 devices, and 8 devices that each split their 2 images into 2 micro-batches.
    for n, k in ((1, 1), (8, 1), (8, 2)):
        mesh = Mesh(np.asarray(jax.devices()[:n]), (parallel.DATA_AXIS,))
        config.grad_accum_steps = k
        parts = setup.build(config, model, spec, mesh, steps_per_epoch=20, total_steps=20)
        state = parts.init(jax.random.PRNGKey(0))
        for batch in batches:
            state, metrics = parts.train_step(state, parallel.to_global(batch, mesh))
            jax.block_until_ready(metrics)  # queued collectives deadlock on 2 CPU cores
        results[n, k] = jax.device_get((state, metrics))
    state1, metrics1 = results[1, 1]
    for state8, metrics8 in (results[8, 1], results[8, 2]):
        for name in ("params", "corruption_params", "opt_state", "corruption_opt_state"):
            for a, b in zip(jax.tree.leaves(getattr(state1, name)), jax.tree.leaves(getattr(state8, name))):
                np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, err_msg=name)
        for key in metrics1:
            np.testing.assert_allclose(metrics1[key], metrics8[key], rtol=1e-4, atol=1e-6, err_msg=key)
    state8, metrics8 = results[8, 1]
    # Inside the sharded step every image still loses exactly the official count of patches.
    num_patches = (32 // model.patch_size) ** 2
    assert metrics8["occluded_fraction"] == rspc.num_occluded(num_patches, 0.1) / num_patches
    print("max param diff", max(float(np.abs(a - b).max()) for a, b in
          zip(jax.tree.leaves(state1.params), jax.tree.leaves(state8.params))))
    try:
        setup.validate_config(smoke_config(sys.argv[1], batch_size=12))
    except ValueError as e:
        assert "batch_size=12 is not divisible by the 8 devices" in str(e), e
    else:
        raise AssertionError("batch 12 on 8 devices was accepted")
    print("EQUAL")
""")


def test_eight_device_step_equals_single_device_step(digits_data_dir):
    result = run_python(["-c", _EQUALITY_SCRIPT, digits_data_dir], devices=8, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "EQUAL" in result.stdout


def test_demo_runs_to_the_end_on_eight_devices(digits_data_dir, tmp_path):
    result = run_python(
        [
            "-m",
            "rspc_jax.main",
            "--config=configs/demo.py:smoke",
            f"--workdir={tmp_path / 'run'}",
            f"--config.data_dir={digits_data_dir}",
            "--config.total_steps=12",
            "--config.batch_size=16",
            "--config.eval_batch_size=64",
        ],
        devices=8,
        timeout=400,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "8 devices (cpu)" in result.stderr  # absl logging
    assert "Done: 12 steps" in result.stderr
