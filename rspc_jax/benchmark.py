"""Speed of train-step variants of a config's model, measured in one run.

    python -m rspc_jax.benchmark --config=configs/demo.py --steps=30
    python -m rspc_jax.benchmark --config=configs/demo.py --variants=plain,rspc,fgsm_at,trades1,trades2,trades3

Every variant runs on the same random global batch in the same process (no input
pipeline), each blocked per step; the table gives compile time, median step time,
images/s (clean images per step / median) and the step-time ratio to the first
variant. Variants: 'plain' (no RSPC), 'rspc', or any name of rspc_jax.ablations
(the adversarial-training baselines of the paper's Fig. 7 among them).
"""

import statistics
import time

from absl import app
from absl import flags
from absl import logging
import jax
import numpy as np
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=False)
_STEPS = flags.DEFINE_integer("steps", 20, "Timed steps per variant (after compilation).")
_BATCH = flags.DEFINE_integer("batch", 0, "Global batch size (0 = the config's).")
_VARIANTS = flags.DEFINE_string("variants", "plain,rspc", "Comma-separated step variants: "
                                "plain, rspc or names of rspc_jax.ablations.")


def time_step(config, spec, batch, steps: int) -> dict:
    """Compiles and times `steps` train steps of `config` on `batch`."""
    from rspc_jax import parallel, train

    model = train.build_model(config, spec.num_classes)
    mesh = parallel.create_mesh()
    parts = train.build(config, model, spec, mesh, steps_per_epoch=1000, total_steps=1000)
    state = parts.init(jax.random.PRNGKey(config.seed))
    global_batch = parallel.to_global(batch, mesh)
    start = time.perf_counter()
    state, metrics = parts.train_step(state, global_batch)
    jax.block_until_ready(metrics)
    compile_sec = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = parts.train_step(state, global_batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return dict(compile_sec=compile_sec, median_sec=median,
                images_per_sec=config.batch_size / median)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    from rspc_jax import input_pipeline, train

    config = _CONFIG.value
    if _BATCH.value:
        config.batch_size = _BATCH.value
    train.validate_config(config)
    spec = input_pipeline.dataset_spec(config.dataset)
    rng = np.random.default_rng(0)
    local = config.batch_size // jax.process_count()
    batch = {"image": rng.standard_normal((local, config.image_size, config.image_size, 3), np.float32),
             "label": rng.integers(0, spec.num_classes, local).astype(np.int32)}
    results = {}
    for name in _VARIANTS.value.split(","):
        results[name] = time_step(variant_config(config, name), spec, batch, _STEPS.value)
    print(f"model {config.model_name}, global batch {config.batch_size} clean images per step "
          f"(RSPC and TRADES put 2x through the classifier), "
          f"{jax.device_count()} x {jax.devices()[0].device_kind}, {_STEPS.value} timed steps")
    first = next(iter(results))
    print(f"{'step':<20} {'compile s':>10} {'median step s':>14} {'images/s':>10} "
          f"{'steps/s':>8} {'x ' + first:>10}")
    for name, r in results.items():
        print(f"{name:<20} {r['compile_sec']:>10.2f} {r['median_sec']:>14.4f} "
              f"{r['images_per_sec']:>10.1f} {1 / r['median_sec']:>8.2f} "
              f"{r['median_sec'] / results[first]['median_sec']:>10.2f}")
    if {"plain", "rspc"} <= set(results):
        ratio = results["rspc"]["median_sec"] / results["plain"]["median_sec"]
        print(f"ratio rspc/plain step time: {ratio:.2f}")


def variant_config(config, name: str):
    """A copy of `config` switched to variant `name`."""
    from rspc_jax import ablations

    config = config.copy_and_resolve_references()
    if name in ("plain", "rspc"):
        config.rspc.enabled = name == "rspc"
        return config
    return ablations.apply(config, name)

if __name__ == "__main__":
    app.run(main)
