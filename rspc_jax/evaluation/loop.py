"""What every suite shares: the `Context` (model, variables, data, settings), the
sharded per-device step and the host loop that keeps only real examples.

Every suite runs one jitted, sharded per-device function over host batches that all
hosts yield in the same number; padded examples carry mask 0 and are dropped on the
host, so each example counts exactly once whatever the device count.
"""

from collections.abc import Callable, Iterator
import dataclasses
import time
from typing import Any, Optional

from absl import logging
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import ml_collections
import numpy as np

from rspc_jax import parallel, rspc
from rspc_jax.data import eval as eval_data
from rspc_jax.data import on_device
from rspc_jax.data import specs as datasets
from rspc_jax.evaluation import occlusion, protocols
from rspc_jax.models import ops

# (this host's iterator of (uint8 image, label), the largest host's example count)
Source = tuple[Iterator[tuple[np.ndarray, int]], int]


# Examples read from tf.data per Python call: one call per example cost the evaluation
# readers their second core; the examples are the same.
READ_BATCH = 64


def as_source(ds, largest: int) -> Source:
    """A tf.data of {'image', 'label'} (input_pipeline's eval/file/array examples) as a Source:
    its examples in order, read READ_BATCH at a time."""

    def examples():
        for batch in ds.batch(READ_BATCH).prefetch(1).as_numpy_iterator():
            yield from zip(batch["image"], batch["label"])

    return examples(), largest


def normaliser(mean, std) -> Callable:
    """Jitted fn(uint8 images (..., 3)) -> float32 normalised, with exactly the bits of the
    host's normalisation (`on_device.normalise`)."""
    table = on_device.pixel_table(mean, std)
    return jax.jit(lambda images: on_device.normalise(images, table))


class SuiteSkipped(Exception):
    """A suite cannot run here (missing data, unsupported model); the message says why."""


@dataclasses.dataclass
class Context:
    """What every suite needs: the model and its variables, the data and the settings."""

    config: ml_collections.ConfigDict  # the run's config (dataset, image size, rspc)
    settings: ml_collections.ConfigDict  # config.evaluation
    model: Any
    variables: dict  # {'params', 'batch_stats'}
    corruption_params: dict | None  # the trained corruption model, if any
    spec: datasets.DatasetSpec
    mesh: Any
    patch_size: int  # RSPC patch size (occlusion grid)
    noise_mean: tuple  # training's occlusion noise and clamp
    noise_std: tuple
    lower: tuple | None
    upper: tuple | None
    seed: int = 0
    compute_dtype: Any = None  # None = float32; e.g. bfloat16 as training runs
    # Jitted steps by name, kept across `with_variables` copies so that repeated passes
    # (training's periodic evaluation) compile once.
    compiled: dict = dataclasses.field(default_factory=dict)

    def with_variables(self, variables: dict) -> "Context":
        return dataclasses.replace(self, variables=variables)

    @property
    def local_batch(self) -> int:
        return (self.settings.batch_size or self.config.eval_batch_size) // jax.process_count()

    def examples(self) -> "Source":
        """The run's eval split (this host's share) after its eval preprocessing."""
        ds, largest = eval_data.eval_examples(
            dataset=self.config.dataset,
            data_dir=self.config.data_dir,
            split=self.config.eval_split or self.spec.eval_split,
            image_size=self.config.image_size,
            eval_preprocess=self.config.eval_preprocess,
        )
        return as_source(ds, largest)

    def batches(
        self,
        source: Optional["Source"] = None,
        *,
        transform=None,
        limit: int = 0,
        image_shape=None,
        local_batch: int = 0,
    ):
        """(global batches on the mesh, number of batches) of `source` (default: the eval
        split); `image_shape` of one example (default: size x size x 3)."""
        examples, largest = source or self.examples()
        limit = limit or self.settings.num_examples
        host_limit = -(-limit // jax.process_count()) if limit else 0
        # No bigger than the examples need (rounded to the devices): padding costs compute.
        devices = jax.local_device_count()
        needed = -(-min(largest, host_limit or largest) // devices) * devices
        local_batch = min(local_batch or self.local_batch, max(needed, devices))
        count = eval_data.num_batches(largest, local_batch, host_limit)
        size = self.config.image_size
        local = eval_data.host_batches(
            examples,
            local_batch=local_batch,
            batches=count,
            image_shape=image_shape or (size, size, 3),
            mean=self.spec.mean,
            std=self.spec.std,
            transform=transform,
            limit=host_limit,
            normalise=False,
        )
        return map(self._normalised, parallel.prefetch_to_mesh(local, self.mesh)), count

    def _normalised(self, batch: dict) -> dict:
        """The uint8 batch normalised on the devices (`normaliser`)."""
        if "normalise" not in self.compiled:
            self.compiled["normalise"] = normaliser(self.spec.mean, self.spec.std)
        return dict(batch, image=self.compiled["normalise"](batch["image"]))

    def logits(self, variables, images, **kwargs):
        return rspc.apply_model(
            self.model,
            variables["params"],
            variables.get("batch_stats", {}),
            images,
            compute_dtype=self.compute_dtype,
            train=False,
            **kwargs,
        )

    def logits_and_attention(self, variables, images):
        logits, state = self.logits(
            variables, images, sow_attention=True, mutable=["intermediates"]
        )
        return logits, list(state["intermediates"]["attention_maps"])

    def occlude(self, images, keep, rng):
        return occlusion.occlude_patches(
            images,
            keep,
            rng,
            patch_size=self.patch_size,
            noise_mean=self.noise_mean,
            noise_std=self.noise_std,
            lower=self.lower,
            upper=self.upper,
        )

    def num_patches(self) -> int:
        return (self.config.image_size // self.patch_size) ** 2

    def occluded_count(self) -> int:
        """Training's count for rho (20 of 196 at 0.1); rho = 0 occludes nothing."""
        rho = self.settings.occlusion_rho
        return rspc.num_occluded(self.num_patches(), rho) if rho > 0 else 0


def sharded(ctx: Context, fn: Callable, name: str = "") -> Callable:
    """jit(shard_map(fn)) with fn(variables, batch, rng) -> per-example outputs (batch axis
    first); each device draws from its own fold of `rng`. A `name` keeps the jitted step in
    `ctx.compiled` for later passes (fn may then use only what the context fixes)."""
    if name and name in ctx.compiled:
        return ctx.compiled[name]

    def per_device(variables, batch, rng):
        return fn(variables, batch, jax.random.fold_in(rng, jax.lax.axis_index(parallel.DATA_AXIS)))

    # check_vma=False: the attacks' loop carries start from per-device constants, which
    # the varying-axes check would ask to pcast one by one; every op here is per device.
    step = jax.jit(
        jax.shard_map(
            per_device,
            mesh=ctx.mesh,
            in_specs=(P(), P(parallel.DATA_AXIS), P()),
            out_specs=P(parallel.DATA_AXIS),
            check_vma=False,
        ),
        compiler_options=ops.compiler_options(),
    )
    if name:
        ctx.compiled[name] = step
    return step


def _to_host(x) -> np.ndarray:
    if jax.process_count() == 1:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def run_pass(
    ctx: Context, step: Callable, rng, *, label: str, host_fn=None, variables=None, **batch_args
) -> dict:
    """Runs `step` over `ctx.batches(**batch_args)`; returns its per-example outputs for
    real examples only, each batch passed through `host_fn` (e.g. logits -> per-video
    metrics, so that big outputs never pile up on the host). `variables` (default
    ctx.variables) is the step's replicated first argument."""
    variables = ctx.variables if variables is None else variables
    batches, count = ctx.batches(**batch_args)
    outputs = []
    start = time.time()
    for i, batch in enumerate(batches):
        out = jax.tree.map(_to_host, step(variables, batch, jax.random.fold_in(rng, i)))
        keep = _to_host(batch["mask"]) > 0
        out = {k: v[keep] for k, v in out.items()}
        outputs.append(host_fn(out) if host_fn else out)
        _progress(label, i + 1, count, start)
    return {k: np.concatenate([o[k] for o in outputs]) for k in outputs[0]}


def sharded_sum(ctx: Context, fn: Callable) -> Callable:
    """jit(shard_map(fn)) with fn(variables, batch) -> a tree of sums over the device's
    examples (masked by batch['mask']), added over all devices."""

    def per_device(variables, batch):
        return jax.tree.map(lambda v: jax.lax.psum(v, parallel.DATA_AXIS), fn(variables, batch))

    return jax.jit(
        jax.shard_map(
            per_device,
            mesh=ctx.mesh,
            in_specs=(P(), P(parallel.DATA_AXIS)),
            out_specs=P(),
            check_vma=False,
        ),
        compiler_options=ops.compiler_options(),
    )


def sum_pass(ctx: Context, step: Callable, *, label: str, **batch_args) -> dict:
    """Runs a `sharded_sum` step over `ctx.batches(**batch_args)`; the sums over all batches."""
    batches, count = ctx.batches(**batch_args)
    total = None
    start = time.time()
    for i, batch in enumerate(batches):
        # The sums are replicated on every device: any local copy holds the value.
        out = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), step(ctx.variables, batch))
        total = out if total is None else jax.tree.map(np.add, total, out)
        _progress(label, i + 1, count, start)
    return total


def _progress(label: str, done: int, total: int, start: float) -> None:
    if jax.process_index() != 0 or total < 10 or not (done == total or done % (total // 10) == 0):
        return
    elapsed = time.time() - start
    eta = elapsed / done * (total - done)
    logging.info(f"[{label}] batch {done}/{total} ({elapsed:.0f}s, ETA {eta:.0f}s)")


def correct(logits, labels, k: int = 1):
    top = jax.lax.top_k(logits.astype(jnp.float32), k)[1]
    return (top == labels[:, None]).any(axis=1)


def accuracy_step(ctx: Context, classes=None) -> Callable:
    """Sharded step -> {'correct'}; with `classes` (1k indices of a 200-class subset) the
    prediction is the best logit among them (ImageNet-A/R)."""

    def step(variables, batch, rng):
        logits = ctx.logits(variables, batch["image"])
        if classes is None:
            return dict(correct=correct(logits, batch["label"]))
        return dict(correct=protocols.restricted_prediction(logits, classes) == batch["label"])

    return sharded(ctx, step)
