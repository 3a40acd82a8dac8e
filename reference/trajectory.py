"""The official RSPC training and ours, step for step, from the same weights on the same batches.

Run by maintainers (nothing imports this file): it needs PyTorch, timm and a checkout of the
official code (guoyongcs/RSPC), e.g.

    python reference/trajectory.py --official_repo ../RSPC --steps 300 --seed 0 --out traj

The model is a tiny official RVT (`robust_models.PoolingTransformer`: image 64, base_dims
[32], depth [4], heads [3], mlp_ratio 4: width 96, 16 tokens; --base_dim, --depth and
--heads change it) with the official C
(`PatchOcclusion(0.1, 3, 16, 16)`), rho 0.1, lambda 0.005, batch 64, on scikit-learn's
digits (nearest-upsampled to 64 px, three channels, normalised with the digits' mean and
std, no augmentation; batches are a seeded permutation per epoch, the last partial batch
dropped). Drop-path, dropout, mixup and EMA are off on both sides; the criterion is the
official one without mixup (LabelSmoothingCrossEntropy(0.1)), ours label_smoothing 0.1.

Three runs share the initial weights (the official model and C built under
`torch.manual_seed(seed)`; ours converted from their state dicts through rspc_jax.interop)
and every batch and noise tensor (ours draws the noise from its step key; the same tensor is
fed to the official side):

- `official`: train_one_epoch_rspc's step restated call by call (C's mask, noise, clamp,
  one forward of [corrupted; clean], criterion + lambda * FeatureAlignmentLoss, timm's
  NativeScaler with its GradScaler on CPU at 2^16 (as benchmarks/official_step.py), AdamW
  from timm, C's gradient clipped to 5, reversed, C's Nesterov SGD), timm's CosineLRScheduler
  stepped after each epoch with `lr_scheduler.step(epoch)` as RSPC_RVT/main.py does;
- `official_f64`: the same in float64: the rounding envelope;
- `ours`: rspc_jax.training's real step (make_train_step, StepSettings from
  setup.step_settings) with config.optimizer.schedule = 'official_epochs'.

Per step it records, for each run, CE, L_align (each side's own definition: the official
one divides by n_blocks + 1e-4), the total loss, the classifier's gradient norm (the official
one unscaled), C's gradient norm before clipping (under the 2^16 scale on both sides), the lr,
each image's keep mask, and BatchNorm summaries; for the pairs (official, official_f64) and
(official, ours): the fraction of images whose masks agree, and relative distances of the
classifier's parameters, C's parameters and the BatchNorm statistics, and for the envelope
the count of stem max-pool windows whose argmax differs. At --probe_steps it
records C's masks on a fixed set of 256 training digits (distinct masks, selection
entropy, modal mask share). It writes trajectory.json and trajectory.png into --out.
--no_envelope leaves out the float64 run (the collapse study: 920 steps, 3 seeds;
docs/study/findings.md). reference/make_fixtures.py records 50 steps of a width-48 RVT with
`fixture_case` for tests/test_trajectory.py. Results: docs/method.md, "The official training,
step for step".
"""

import argparse
import copy
import json
import math
import pathlib
import sys
from typing import NamedTuple

import numpy as np
import timm.loss
import timm.optim
import timm.scheduler
import torch
import torchvision.ops  # noqa: F401  (imported before JAX: triton's import crashes after it)

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import official_step  # noqa: E402
from rspc_jax import parallel, rspc  # noqa: E402
from rspc_jax.data import sklearn_digits  # noqa: E402
from rspc_jax.data import specs as data_specs  # noqa: E402
from rspc_jax.evaluation import selection  # noqa: E402
from rspc_jax.interop import state_dicts as interop  # noqa: E402
from rspc_jax.training import defaults, setup  # noqa: E402
from rspc_jax.training import step as step_lib  # noqa: E402

IMAGE = 64
PATCH = 16
NUM_PATCHES = (IMAGE // PATCH) ** 2
BATCH = 64
RHO = 0.1
LAMBDA = 0.005
SMOOTHING = 0.1
LOSS_SCALE = 2.0**16
C_CLIP = 5.0
OFFICIAL_RVT_KWARGS = dict(
    image_size=IMAGE,
    patch_size=16,
    stride=16,
    mlp_ratio=4,
    num_classes=10,
    drop_rate=0.0,
    attn_drop_rate=0.0,
    drop_path_rate=0.0,
    use_mask=False,
    masked_block=None,
)
PROBE_IMAGES = 256
BN_BUFFERS = ("running_mean", "running_var")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--official_repo", type=pathlib.Path, required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--lr", type=float, default=5e-4, help="main.py's, scaled by batch/512")
    parser.add_argument("--warmup_epochs", type=int, default=5)
    parser.add_argument("--probe_steps", type=int, nargs="*", default=[50, 150, 300])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--base_dim", type=int, default=32, help="width per head")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument(
        "--no_envelope", action="store_true", help="skip the float64 run (collapse studies)"
    )
    args = parser.parse_args(argv)
    official_step.check_official_repo(parser, args.official_repo)
    return args


# ------------------------------------------------------------------------------------------
# Data


def batch_indices(num_examples: int, steps: int, seed: int) -> list:
    """Each step's example indices: a seeded permutation per epoch, the last partial batch
    dropped (the official loader's drop_last)."""
    rng = np.random.default_rng(seed)
    per_epoch = num_examples // BATCH
    batches = []
    while len(batches) < steps:
        order = rng.permutation(num_examples)
        batches += [order[i * BATCH : (i + 1) * BATCH] for i in range(per_epoch)]
    return batches[:steps]


# ------------------------------------------------------------------------------------------
# The official side


class OfficialRun:
    """The official model, C, optimizers, scaler and scheduler, in `dtype`."""

    def __init__(self, modules, model, occlusion, args, epochs: int, dtype):
        _, self.utils, losses = modules
        self.dtype = dtype
        self.model = copy.deepcopy(model).to(dtype)
        self.occlusion = copy.deepcopy(occlusion).to(dtype)
        # The conv stem's max-pool input of the last forward: where its argmax is a near-tie,
        # rounding decides which pixel gets the gradient (docs/method.md).
        self.stem_pool = self.model.patch_embed.proj[2]
        self.stem_pool.register_forward_hook(
            lambda module, inputs, output: setattr(self, "stem_pool_input", inputs[0].detach())
        )
        peak = args.lr * BATCH / 512.0
        self.optimizer = timm.optim.create_optimizer_v2(
            self.model, opt="adamw", lr=peak, weight_decay=0.05
        )
        sched_args = argparse.Namespace(
            sched="cosine",
            epochs=epochs,
            min_lr=1e-5,
            warmup_lr=1e-6,
            warmup_epochs=args.warmup_epochs,
            cooldown_epochs=0,
            decay_epochs=30,
            decay_rate=0.1,
            lr_noise=None,
        )
        self.scheduler, _ = timm.scheduler.create_scheduler(sched_args, self.optimizer)
        self.occlusion_optimizer = torch.optim.SGD(
            self.occlusion.parameters(), momentum=0.9, nesterov=True, lr=1e-4, weight_decay=0.05
        )
        self.scaler = torch.amp.GradScaler("cpu", init_scale=LOSS_SCALE)
        self.criterion = losses.DistillationLoss(
            timm.loss.LabelSmoothingCrossEntropy(smoothing=SMOOTHING), None, "none", 0.5, 1.0
        )
        mean = torch.tensor((0.485, 0.456, 0.406), dtype=dtype).view(3, 1, 1)
        std = torch.tensor((0.229, 0.224, 0.225), dtype=dtype).view(3, 1, 1)
        self.lower, self.upper = (0 - mean) / std, (1 - mean) / std

    def masks(self, images_nchw: torch.Tensor) -> np.ndarray:
        """C's keep masks (B, N), row-major over the patch grid."""
        with torch.no_grad():
            mask = self.occlusion(images_nchw.to(self.dtype))
        return mask[:, 0, ::PATCH, ::PATCH].reshape(mask.shape[0], -1).numpy().astype(np.int8)

    def step(self, images_nchw, labels, noise_nchw) -> dict:
        """One iteration of train_one_epoch_rspc (no patch aug, no mixup)."""
        samples, noise = images_nchw.to(self.dtype), noise_nchw.to(self.dtype)
        self.model.train()
        lr = self.optimizer.param_groups[0]["lr"]
        scale = self.scaler.get_scale()
        noise_mask, outputs = official_step.rspc_forward(
            torch, self.model, self.occlusion, samples, noise, self.lower, self.upper
        )
        ce = self.criterion(samples, outputs, labels)
        align = self.utils.FeatureAlignmentLoss(self.model)
        loss = ce + LAMBDA * align
        self.optimizer.zero_grad()
        self.occlusion_optimizer.zero_grad()
        self.scaler.scale(loss).backward()  # NativeScaler.__call__ without clipping
        grad_norm = _norm(p.grad for p in self.model.parameters()) / self.scaler.get_scale()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        c_norm = torch.nn.utils.clip_grad_norm_(self.occlusion.parameters(), C_CLIP)
        self.utils.reverse_grad(self.occlusion_optimizer)
        self.occlusion_optimizer.step()
        keep = noise_mask[:, 0, ::PATCH, ::PATCH].reshape(samples.shape[0], -1)
        return dict(
            ce=ce.item(),
            align=align.item(),
            loss=loss.item(),
            grad_norm=float(grad_norm),
            c_grad_norm=float(c_norm),
            lr=lr,
            loss_scale=scale,
            masks=keep.detach().numpy().astype(np.int8),
        )

    def end_epoch(self, epoch: int) -> None:
        self.scheduler.step(epoch)  # RSPC_RVT/main.py: after epoch `epoch`

    def state(self) -> tuple[dict, dict]:
        """(classifier state dict, C's) as float64 numpy."""
        to_np = lambda sd: {k: v.detach().double().numpy() for k, v in sd.items()}  # noqa: E731
        return to_np(self.model.state_dict()), to_np(self.occlusion.state_dict())


def _norm(tensors) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors if t is not None))


# ------------------------------------------------------------------------------------------
# Our side


def our_overrides(args, epochs: int, steps_per_epoch: int) -> dict:
    """Our side's run config as flattened overrides of the defaults (the tiny RVT, this
    comparison's recipe); the recorded fixture keeps them for the replay test."""
    return {
        "model_name": "rvt_small",
        "model.base_dims": [args.base_dim],
        "model.depth": [args.depth],
        "model.heads": [args.heads],
        "model.mlp_ratio": 4,
        "image_size": IMAGE,
        "batch_size": BATCH,
        "label_smoothing": SMOOTHING,
        "ema_decay": 0.0,
        "optimizer.lr": args.lr,
        "optimizer.warmup_epochs": float(args.warmup_epochs),
        "optimizer.cooldown_epochs": 0.0,
        "optimizer.schedule": "official_epochs",
        "num_epochs": float(epochs),
        "total_steps": epochs * steps_per_epoch,
        "rspc.rho": RHO,
        "rspc.lam": LAMBDA,
        "rspc.patch_size": PATCH,
        "rspc.corruption_grad_scale": LOSS_SCALE,
    }


def our_config(overrides: dict):
    config = defaults.get_default_config()
    config.update_from_flattened_dict(overrides)
    return config


class OurRun:
    """rspc_jax's train step (setup.build, as a training run builds it) from the official
    initial weights."""

    def __init__(self, config, spec, official_state, official_c_state, steps_per_epoch, seed):
        self.model = setup.build_model(config, num_classes=10)
        self.corruption = rspc.make_corruption_model(config.rspc, PATCH)
        parts = setup.build(
            config, self.model, spec, parallel.create_mesh(), steps_per_epoch, config.total_steps
        )
        state = parts.init(jax.random.PRNGKey(seed))
        variables = interop.load_variables(
            official_state,
            dict(params=state.params, batch_stats=state.batch_stats),
            source="official",
        )
        c_params = interop.load_variables(
            official_c_state, dict(params=state.corruption_params), source="official C"
        )["params"]
        # The optimizer states of a fresh run do not depend on the parameters' values.
        self.state = state.replace(
            params=variables["params"],
            batch_stats=variables["batch_stats"],
            corruption_params=c_params,
        )
        self.step_fn = parts.train_step
        self.scores = jax.jit(lambda p, x: self.corruption.apply({"params": p}, x))
        self.num_blocks = sum(config.model["depth"])

    def noise(self) -> np.ndarray:
        """The occlusion noise this step draws (rspc.occlusion_noise, normalised space)."""
        key = step_lib.step_keys(self.state)[0]
        return np.asarray(rspc.uniform_noise(key, jnp.arange(BATCH), (IMAGE, IMAGE, 3)))

    def masks(self, images_nhwc) -> np.ndarray:
        scores = self.scores(self.state.corruption_params, images_nhwc)
        return np.asarray(rspc.keep_mask(scores, RHO)).astype(np.int8)

    def step(self, images_nhwc, labels) -> dict:
        masks = self.masks(images_nhwc)
        batch = dict(image=jnp.asarray(images_nhwc), label=jnp.asarray(labels))
        self.state, metrics = self.step_fn(self.state, batch)
        metrics = jax.device_get(metrics)
        # The official FeatureAlignmentLoss divides by n_blocks + 1e-4, ours by n_blocks
        # (tests/test_rspc.py): `align` is ours in the official definition.
        return dict(
            ce=float(metrics["ce"]),
            align=float(metrics["align"]) * self.num_blocks / (self.num_blocks + 1e-4),
            align_own=float(metrics["align"]),
            loss=float(metrics["loss"]),
            grad_norm=float(metrics["grad_norm"]),
            c_grad_norm=float(metrics["corruption_grad_norm"]),
            lr=float(metrics["lr"]),
            masks=masks,
        )

    def state_dicts(self) -> tuple[dict, dict]:
        variables = dict(params=self.state.params, batch_stats=self.state.batch_stats)
        classifier = interop.export_state_dict(variables)
        c = interop.export_state_dict(dict(params=self.state.corruption_params))
        as64 = lambda sd: {k: np.asarray(v, np.float64) for k, v in sd.items()}  # noqa: E731
        return as64(classifier), as64(c)


# ------------------------------------------------------------------------------------------
# Comparison


def _split(state: dict) -> tuple[dict, dict]:
    """(parameters, BatchNorm statistics) of a classifier state dict."""
    bn = {k: v for k, v in state.items() if k.endswith(BN_BUFFERS)}
    params = {k: v for k, v in state.items() if k not in bn and "num_batches_tracked" not in k}
    return params, bn


def relative_distance(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over the keys of b."""
    diff = math.sqrt(sum(float(np.sum((a[k] - b[k]) ** 2)) for k in b))
    return diff / max(math.sqrt(sum(float(np.sum(b[k] ** 2)) for k in b)), 1e-30)


def bn_summary(bn: dict) -> dict:
    means = np.concatenate([v.ravel() for k, v in bn.items() if k.endswith("running_mean")])
    variances = np.concatenate([v.ravel() for k, v in bn.items() if k.endswith("running_var")])
    return dict(bn_mean_abs=float(np.abs(means).mean()), bn_var_mean=float(variances.mean()))


def _buffers(pair, suffix: str):
    return tuple({k: v for k, v in bn.items() if k.endswith(suffix)} for bn in pair)


def pair_record(a: dict, b: dict, states_a, states_b) -> dict:
    (pa, bna), (pb, bnb) = _split(states_a[0]), _split(states_b[0])
    return dict(
        mask_agreement=float(np.mean(np.all(a["masks"] == b["masks"], axis=1))),
        classifier_distance=relative_distance(pa, pb),
        c_distance=relative_distance(states_a[1], states_b[1]),
        bn_mean_distance=relative_distance(*_buffers((bna, bnb), "running_mean")),
        bn_var_distance=relative_distance(*_buffers((bna, bnb), "running_var")),
        **{f"{k}_rel_diff": abs(a[k] - b[k]) / max(abs(b[k]), 1e-30) for k in SCALARS},
    )


SCALARS = ("ce", "align", "loss", "grad_norm", "c_grad_norm", "lr")


def probe(masks: np.ndarray) -> dict:
    """The study's collapse diagnostics of C's keep masks on the probe images."""
    occluded = 1 - masks
    return dict(
        distinct_masks=int(selection.distinct_masks(occluded)),
        entropy=float(selection.selection_entropy(occluded)),
        modal_mask_share=float(selection.modal_mask_share(occluded)),
    )


class Comparison(NamedTuple):
    """The runs of one comparison and what they train on."""

    images: np.ndarray
    labels: np.ndarray
    steps_per_epoch: int
    epochs: int
    official: dict  # name -> OfficialRun: "official" and, unless --no_envelope, "official_f64"
    ours: OurRun
    initial: tuple  # the official (classifier, C) state dicts both sides start from


def build(args) -> Comparison:
    torch.set_num_threads(args.threads)
    spec = data_specs.dataset_spec("sklearn_digits")
    images, labels = sklearn_digits.upsampled_train_arrays(IMAGE, spec.mean, spec.std)
    steps_per_epoch = len(images) // BATCH
    epochs = math.ceil(args.steps / steps_per_epoch)
    modules = official_step.official_modules(args.official_repo)
    torch.manual_seed(args.seed)
    model = modules[0].PoolingTransformer(
        base_dims=[args.base_dim], depth=[args.depth], heads=[args.heads], **OFFICIAL_RVT_KWARGS
    )
    occlusion = modules[0].PatchOcclusion(RHO, 3, PATCH, NUM_PATCHES)
    official = dict(official=OfficialRun(modules, model, occlusion, args, epochs, torch.float32))
    if not args.no_envelope:
        official["official_f64"] = OfficialRun(
            modules, model, occlusion, args, epochs, torch.float64
        )
    initial = official["official"].state()
    config = our_config(our_overrides(args, epochs, steps_per_epoch))
    ours = OurRun(config, spec, *initial, steps_per_epoch, args.seed)
    return Comparison(images, labels, steps_per_epoch, epochs, official, ours, initial)


def step_record(comparison: Comparison, step: int, index: np.ndarray) -> dict:
    """Step `step` (from 0) of every run on the examples `index`, and its record."""
    if step and step % comparison.steps_per_epoch == 0:
        for r in comparison.official.values():
            r.end_epoch(step // comparison.steps_per_epoch - 1)
    x, y = comparison.images[index], comparison.labels[index]
    x_t = torch.from_numpy(x.transpose(0, 3, 1, 2).copy())
    noise_t = torch.from_numpy(comparison.ours.noise().transpose(0, 3, 1, 2).copy())
    y_t = torch.from_numpy(y.astype(np.int64))
    out = {name: r.step(x_t, y_t, noise_t) for name, r in comparison.official.items()}
    out["ours"] = comparison.ours.step(x, y)
    states = {name: r.state() for name, r in comparison.official.items()}
    states["ours"] = comparison.ours.state_dicts()
    record = dict(step=step + 1)
    for name, o in out.items():
        scalars = {k: v for k, v in o.items() if k != "masks"}
        record[name] = dict(scalars, **bn_summary(_split(states[name][0])[1]))
        record[name]["masks"] = ["".join(map(str, m)) for m in o["masks"]]
    if "official_f64" in out:
        record["envelope"] = pair_record(
            out["official_f64"], out["official"], states["official_f64"], states["official"]
        )
        record["envelope"]["stem_argmax_flips"] = stem_argmax_flips(
            comparison.official["official_f64"], comparison.official["official"]
        )
    record["ours_vs_official"] = pair_record(
        out["ours"], out["official"], states["ours"], states["official"]
    )
    return record


def stem_argmax_flips(a: OfficialRun, b: OfficialRun) -> int:
    """The stem max-pool windows whose argmax differs between the two runs' last forwards."""
    pool = a.stem_pool
    indices = [
        torch.nn.functional.max_pool2d(
            r.stem_pool_input.double(),
            pool.kernel_size,
            pool.stride,
            pool.padding,
            return_indices=True,
        )[1]
        for r in (a, b)
    ]
    return int((indices[0] != indices[1]).sum())


def probe_record(comparison: Comparison) -> dict:
    """The collapse diagnostics of every run's C on the first PROBE_IMAGES training digits."""
    images = comparison.images[:PROBE_IMAGES]
    nchw = torch.from_numpy(images.transpose(0, 3, 1, 2).copy())
    return dict(
        {name: probe(r.masks(nchw)) for name, r in comparison.official.items()},
        ours=probe(comparison.ours.masks(jnp.asarray(images))),
    )


def run(args) -> tuple[dict, Comparison]:
    """The comparison's result (the JSON), and the runs as they ended."""
    comparison = build(args)
    records, probes = [], {}
    batches = batch_indices(len(comparison.images), args.steps, args.seed)
    for step, index in enumerate(batches):
        records.append(step_record(comparison, step, index))
        if step + 1 in args.probe_steps:
            probes[step + 1] = probe_record(comparison)
        print(_progress(records[-1]), flush=True)
    settings = dict(
        vars(args),
        official_repo=str(args.official_repo),
        out=str(args.out),
        steps_per_epoch=comparison.steps_per_epoch,
        epochs=comparison.epochs,
        batch=BATCH,
        image=IMAGE,
        rho=RHO,
        lam=LAMBDA,
        label_smoothing=SMOOTHING,
        loss_scale=LOSS_SCALE,
        torch=torch.__version__,
        jax=jax.__version__,
    )
    result = dict(settings=settings, steps=records, probes=probes, summary=summarize(records))
    return result, comparison


def _progress(record: dict) -> str:
    ours = record["ours_vs_official"]
    env = record.get("envelope", {})
    show = lambda pair, key: f"{pair[key]:.2e}" if key in pair else "-"  # noqa: E731
    return (
        f"step {record['step']}: loss {record['official']['loss']:.5f} / "
        f"{record['ours']['loss']:.5f}; classifier dist env {show(env, 'classifier_distance')} "
        f"ours {show(ours, 'classifier_distance')}; C dist env {show(env, 'c_distance')} ours "
        f"{show(ours, 'c_distance')}; masks agree env {show(env, 'mask_agreement')} ours "
        f"{show(ours, 'mask_agreement')}"
    )


QUANTITIES = ("classifier_distance", "c_distance", "bn_mean_distance", "bn_var_distance") + tuple(
    f"{k}_rel_diff" for k in SCALARS
)


def summarize(records: list, factor: float = 10.0) -> dict:
    """First step where any mask differs on each pair; for each quantity the first step where
    ours exceeds `factor` times the envelope (the running maximum of the envelope so far, so
    that one step's lucky agreement of the two official runs does not count)."""
    pairs = [p for p in ("envelope", "ours_vs_official") if p in records[0]]
    first_mask = {
        pair: next((r["step"] for r in records if r[pair]["mask_agreement"] < 1.0), None)
        for pair in pairs
    }
    leaves = {}
    for q in QUANTITIES if "envelope" in pairs else ():
        worst_envelope = 0.0
        for r in records:
            worst_envelope = max(worst_envelope, r["envelope"][q])
            if r["ours_vs_official"][q] > factor * max(worst_envelope, 1e-7):
                leaves[q] = dict(
                    step=r["step"], ours=r["ours_vs_official"][q], envelope=worst_envelope
                )
                break
    return dict(first_mask_difference=first_mask, leaves_envelope=leaves, factor=factor)


def summary_table(records: list, factor: float = 10.0) -> str:
    """The comparison's printed result: per quantity the envelope and ours at the last step,
    the largest ratio of ours to the envelope's running maximum and where, and the first step
    over `factor` times it; then the first step where any mask differs on each pair."""
    lines = [
        f"{'quantity':<22} {'envelope':>9} {'ours':>9} {'max ours/env':>13} {'at':>5} "
        f"{f'>{factor:g}x at':>9}"
    ]
    for q in QUANTITIES if "envelope" in records[0] else ():
        worst, largest, at, first = 0.0, 0.0, None, None
        for r in records:
            worst = max(worst, r["envelope"][q])
            ratio = r["ours_vs_official"][q] / max(worst, 1e-7)
            if ratio > largest:
                largest, at = ratio, r["step"]
            if ratio > factor and first is None:
                first = r["step"]
        last = records[-1]
        lines.append(
            f"{q:<22} {last['envelope'][q]:>9.2e} {last['ours_vs_official'][q]:>9.2e} "
            f"{largest:>13.2f} {at:>5} {first or '-':>9}"
        )
    for pair, step in summarize(records, factor)["first_mask_difference"].items():
        lines.append(f"first step where a mask differs, {pair}: {step or 'none'}")
    return "\n".join(lines)


FIXTURE_CASE = "rspc_trajectory_rvt"


def fixture_case(args, result: dict, comparison: Comparison) -> dict:
    """The run as a reference fixture case (reference/make_fixtures.py writes it) of kind
    rspc_trajectory: the initial official weights, each step's examples, the official
    float32 run's per-step scalars and masks and its final weights, and the envelope
    (float32 against float64) per step, for tests/test_trajectory.py to replay our side
    against without torch."""
    steps = result["steps"]
    final_classifier, final_c = comparison.official["official"].state()
    outputs = {f"official_{k}": np.array([r["official"][k] for r in steps]) for k in SCALARS}
    outputs["official_masks"] = np.array(
        [[[int(c) for c in m] for m in r["official"]["masks"]] for r in steps], np.int8
    )
    for q in (*QUANTITIES, "mask_agreement"):
        outputs[f"envelope_{q}"] = np.array([r["envelope"][q] for r in steps])
    outputs.update(
        {f"final_classifier.{k}": v.astype(np.float32) for k, v in final_classifier.items()}
    )
    outputs.update({f"final_c.{k}": v.astype(np.float32) for k, v in final_c.items()})
    batches = batch_indices(len(comparison.images), args.steps, args.seed)
    config = dict(
        case=FIXTURE_CASE,
        kind="rspc_trajectory",
        steps=args.steps,
        batch=BATCH,
        trajectory_seed=args.seed,
        num_classes=10,
        num_blocks=args.depth,
        our_config=our_overrides(args, comparison.epochs, comparison.steps_per_epoch),
        data="sklearn_digits training images, 8 px nearest-upsampled to 64 px, 3 channels, "
        "normalised with the dataset spec's mean and std; inputs.npz batch_indices[step] are "
        "each step's examples",
        official="PoolingTransformer(image_size=64, patch_size=16, stride=16, base_dims="
        f"[{args.base_dim}], depth=[{args.depth}], heads=[{args.heads}], mlp_ratio=4), "
        f"PatchOcclusion({RHO}, 3, {PATCH}, {NUM_PATCHES}), torch.manual_seed({args.seed})",
        summary=result["summary"],
    )
    return dict(
        config=config,
        inputs=dict(batch_indices=np.array(batches, np.int16)),
        outputs=outputs,
        state={k: v.astype(np.float32) for k, v in comparison.initial[0].items()},
        occ_state={k: v.astype(np.float32) for k, v in comparison.initial[1].items()},
    )


def figure(result: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in result["steps"]]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    runs = [name for name in ("official", "official_f64", "ours") if name in result["steps"][0]]
    pairs = [p for p in ("envelope", "ours_vs_official") if p in result["steps"][0]]
    for ax, key in zip(axes[0], ("loss", "grad_norm", "c_grad_norm")):
        for name in runs:
            ax.plot(steps, [r[name][key] for r in result["steps"]], label=name, lw=1)
        ax.set_title(key)
        ax.legend()
    ax = axes[1][0]
    for pair in pairs:
        ax.plot(steps, [r[pair]["mask_agreement"] for r in result["steps"]], label=pair, lw=1)
    ax.set_title("fraction of images with the same mask")
    ax.legend()
    for ax, key in zip(axes[1][1:], ("classifier_distance", "c_distance")):
        for pair in pairs:
            values = [max(r[pair][key], 1e-12) for r in result["steps"]]
            ax.semilogy(steps, values, label=pair, lw=1)
        ax.set_title(f"relative {key} to the official float32 run")
        ax.legend()
    for ax in axes.flat:
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    result, _ = run(args)
    (args.out / "trajectory.json").write_text(json.dumps(result, indent=1))
    figure(result, args.out / "trajectory.png")
    print(summary_table(result["steps"]))


if __name__ == "__main__":
    main()
