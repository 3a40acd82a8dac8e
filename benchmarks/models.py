"""Parameter count and forward+backward speed of registered models, measured in one run.

    python -m benchmarks.models --batch=8 --steps=3
    python -m benchmarks.models --models=rvt_base_plus --compute_dtype=bfloat16 --remat

Each model is initialised for 1000 classes at --image_size, then the gradient of the
cross-entropy with respect to all parameters (train mode: drop path, BatchNorm batch
statistics) is compiled and timed on one random batch, blocking per step. The table gives
the exact parameter count, compile time, median step time and images/s.
"""

import functools
import statistics
import time

from absl import app, flags
from clu import parameter_overview
import jax
import jax.numpy as jnp

from rspc_jax import models, rspc

# The models of the model-zoo issue, in paper order.
DEFAULT_MODELS = (
    "rvt_tiny",
    "rvt_tiny_plus",
    "rvt_small",
    "rvt_small_plus",
    "rvt_base",
    "rvt_base_plus",
    "fan_tiny_8_p4_hybrid",
    "fan_small_12_p4_hybrid",
    "fan_base_16_p4_hybrid",
    "fan_large_16_p4_hybrid",
    "fan_tiny_12_p16_224",
    "fan_small_12_p16_224",
    "xcit_nano_12_p16_224",
    "xcit_tiny_12_p16_224",
    "xcit_small_12_p16_224",
    "xcit_medium_24_p16_224",
    "xcit_medium_12_p16_224",
    "xcit_large_12_p16_224",
    "deit_tiny_patch16_224",
    "deit_small_patch16_224",
    "deit_base_patch16_224",
)

_MODELS = flags.DEFINE_list("models", list(DEFAULT_MODELS), "Registered model names.")
_BATCH = flags.DEFINE_integer("batch", 8, "Batch size.")
_IMAGE_SIZE = flags.DEFINE_integer("image_size", 224, "Square input size.")
_STEPS = flags.DEFINE_integer("steps", 3, "Timed steps per model (after compilation).")
_DTYPE = flags.DEFINE_enum(
    "compute_dtype",
    "float32",
    ["float32", "bfloat16"],
    "Forward-pass dtype (parameters stay float32).",
)
_REMAT = flags.DEFINE_bool("remat", False, "Rematerialise every block.")


def measure(
    name: str, *, batch: int, image_size: int, steps: int, compute_dtype, remat: bool
) -> dict:
    """Compiles and times the forward+backward pass of model `name`."""
    overrides = {"remat": True} if remat else {}
    model = models.create(name, num_classes=1000, **overrides)
    images = jax.random.normal(jax.random.PRNGKey(0), (batch, image_size, image_size, 3))
    targets = jax.nn.one_hot(jnp.arange(batch) % 1000, 1000)
    variables = jax.jit(functools.partial(model.init, train=False))(
        jax.random.PRNGKey(1), images[:1]
    )
    batch_stats = variables.get("batch_stats", {})

    def loss(params):
        rngs = {"dropout": jax.random.PRNGKey(2)}
        ce, _ = rspc.plain_loss(
            params,
            batch_stats,
            images,
            targets,
            model=model,
            rngs=rngs,
            compute_dtype=compute_dtype,
        )
        return ce

    grad = jax.jit(jax.grad(loss))
    start = time.perf_counter()
    jax.block_until_ready(grad(variables["params"]))
    compile_sec = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(grad(variables["params"]))
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return dict(
        params=int(parameter_overview.count_parameters(variables["params"])),
        compile_sec=compile_sec,
        median_sec=median,
        images_per_sec=batch / median,
    )


def main(argv):
    del argv
    dtype = None if _DTYPE.value == "float32" else jnp.dtype(_DTYPE.value)
    print(
        f"devices: {jax.devices()}; batch {_BATCH.value} at {_IMAGE_SIZE.value}px, "
        f"{_DTYPE.value}, remat={_REMAT.value}, median of {_STEPS.value} steps"
    )
    print("| model | parameters | compile s | fwd+bwd s/step | images/s |")
    print("|---|---:|---:|---:|---:|")
    for name in _MODELS.value:
        r = measure(
            name,
            batch=_BATCH.value,
            image_size=_IMAGE_SIZE.value,
            steps=_STEPS.value,
            compute_dtype=dtype,
            remat=_REMAT.value,
        )
        print(
            f"| {name} | {r['params']:,} | {r['compile_sec']:.1f} | {r['median_sec']:.3f} | "
            f"{r['images_per_sec']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    app.run(main)
