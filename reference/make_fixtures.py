"""Writes the reference fixtures of the parity tests from the official PyTorch code.

Run by maintainers, never by users, CI or the tests (nothing imports this file): it needs
PyTorch, timm and a checkout of the official RSPC code (guoyongcs/RSPC), e.g.

    python reference/make_fixtures.py --official_repo ../RSPC

It writes tests/fixtures/reference/ (index.json and one folder per case: config.json,
state_dict.npz, inputs.npz, outputs.npz) and tests/fixtures/torch_keys/ (the full-size
models' state-dict key manifests and params.json). The cases are reduced official models
(small widths, depths and images, batch 2) that keep each structure the tests check: RVT-Ti*
(conv stem, PAAS, conv-MLP with BatchNorm, depthwise pooling, two stages), RVT-B* (width 768:
the Linear MLP path, PAAS in one of two blocks), FAN-Hybrid (ConvNeXt stem, HybridEmbed,
Fourier encoding, FAN blocks, class attention), the patch-occlusion model C (quantile mask,
fold, clamp, straight-through estimator), one RSPC training forward/backward (soft-target
CE, the alignment loss with lambda, C's gradients unscaled and under the AMP loss scale),
and 50 training steps of a tiny official RVT on the digits (reference/trajectory.py's
comparison, recorded; its weights are the official initialisation, batch 64).

Weights are synthetic (every tensor redrawn from seeded distributions, BatchNorm statistics
calibrated, then perturbed) so that every tensor moves the outputs. The 768-wide
matrices of RVT-B* are sparse (1 entry in 64 nonzero) so that the compressed archives stay
small; every other tensor is dense. Images hold 8-bit pixel values (as decoded images do),
which also compress. Every case is checked before it is written: its state dict is loaded
strictly into a freshly built official model (another seed) and every output is recomputed
bit for bit; binary decisions (quantile thresholds, clamp limits, max-pool argmaxes,
hardtanh branches) are checked for margins, redrawing the inputs when one is too close.
"""

import argparse
from collections.abc import Iterator
import importlib
import json
import pathlib
import platform
import sys

import numpy as np
import torch
import torch.nn.functional as F

REPO = pathlib.Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "fixtures"
SEED = 0
BATCH = 2
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
SPARSE_MIN_NUMEL = 1 << 16  # weight matrices this large are drawn sparse
SPARSE_DENSITY = 1 / 64
LOSS_SCALE = 65536.0  # the AMP GradScaler's initial scale
RSPC_LAMBDA = 0.005  # the official --extra_weight
MARGIN = 1e-3  # quantile thresholds and hardtanh branch points
MAXPOOL_GAP = 1e-6
MAX_ATTEMPTS = 20

# Reduced constructors. PAAS masks are (heads, 196, 196) in the official code, so the PAAS
# cases use 224 px images; the others use 64 px.
RVT_TI = dict(
    image_size=224,
    patch_size=16,
    stride=16,
    base_dims=[8, 8],
    depth=[2, 1],
    heads=[2, 4],
    mlp_ratio=4,
    num_classes=10,
    use_mask=True,
    masked_block=2,
)
RVT_B = dict(
    image_size=224,
    patch_size=16,
    stride=16,
    base_dims=[384],
    depth=[2],
    heads=[2],
    mlp_ratio=0.25,
    num_classes=10,
    use_mask=True,
    masked_block=1,
)
RVT_TRAIN = dict(RVT_TI, image_size=64, use_mask=False, masked_block=None)
FAN_BACKBONE = dict(
    pretrained=False, pretrained_strict=False, depths=[1, 1], dims=[16, 32, 64, 128], use_head=False
)
FAN_KWARGS = dict(
    img_size=64,
    patch_size=16,
    embed_dim=32,
    depth=2,
    num_heads=2,
    mlp_ratio=4.0,
    qkv_bias=True,
    sr_ratio=[1, 1],
    eta=1.0,
    tokens_norm=True,
    sharpen_attn=False,
    num_classes=10,
    cls_attn_layers=2,
)
OCCLUSION_ARGS = [0.1, 3, 8, 64]  # mask_ratio, in_chans, patch_size, num_patches (64 px)


# ------------------------------------------------------------------------------------------
# The official code


class Official:
    """The official modules, imported from a checkout of guoyongcs/RSPC."""

    def __init__(self, repo: pathlib.Path):
        self.repo = repo
        sys.path[:0] = [str(repo / "RSPC_RVT"), str(repo / "RSPC_FAN")]
        self.rvt = importlib.import_module("robust_models")
        self.utils = importlib.import_module("utils")
        self.losses = importlib.import_module("losses")
        self.fan = importlib.import_module("models.fan")
        self.convnext = importlib.import_module("models.convnext_utils")

    def commit(self) -> str:
        head = self.repo / ".git" / "HEAD"
        if not head.is_file():
            return "unknown (not a git checkout)"
        ref = head.read_text().strip()
        if ref.startswith("ref: "):
            ref = (self.repo / ".git" / ref[5:]).read_text().strip()
        return ref


def software() -> dict:
    import timm

    return dict(
        torch=torch.__version__,
        timm=timm.__version__,
        numpy=np.__version__,
        python=platform.python_version(),
        device="cpu",
        torch_num_threads=torch.get_num_threads(),
    )


# ------------------------------------------------------------------------------------------
# Synthetic weights and inputs


def redraw(model: torch.nn.Module, gen: torch.Generator, calibration: torch.Tensor) -> None:
    """Every floating tensor redrawn (INIT_POLICY), BatchNorm statistics calibrated."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_draw(name, p, gen))
        _calibrate_batchnorm(model, calibration, gen)


INIT_POLICY = {
    "weight_ndim_ge2": "N(0, 1/fan_in), fan_in = prod(shape[1:]); matrices of at least "
    f"{SPARSE_MIN_NUMEL} entries: each entry nonzero with probability {SPARSE_DENSITY:.6g}, "
    "N(0, 1/(fan_in*density)) where nonzero",
    "bias": "N(0, 0.1^2)",
    "weight_ndim_1": "U(0.5, 1.5) (LayerNorm / BatchNorm scales)",
    "layer_scale_and_temperature": "U(0.5, 1.5) (gamma, gamma1, gamma2, temperature)",
    "att_mask_and_cls_token": "N(0, 1)",
    "batchnorm_running_stats": "batch statistics of a train-mode forward (momentum 1) on 4 "
    "separate images, then running_mean += 0.2*sqrt(var)*N(0,1), running_var *= exp(U(-0.5, 0.5))",
}


def _draw(name: str, p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    leaf = name.split(".")[-1]
    if leaf in ("att_mask", "cls_token"):
        return torch.randn(p.shape, generator=gen)
    if leaf in ("gamma", "gamma1", "gamma2", "temperature") or (p.ndim == 1 and leaf == "weight"):
        return 0.5 + torch.rand(p.shape, generator=gen)
    if p.ndim == 1:
        return 0.1 * torch.randn(p.shape, generator=gen)
    fan_in = int(np.prod(p.shape[1:]))
    if p.numel() < SPARSE_MIN_NUMEL:
        return torch.randn(p.shape, generator=gen) / fan_in**0.5
    keep = torch.rand(p.shape, generator=gen) < SPARSE_DENSITY
    values = torch.randn(p.shape, generator=gen) / (fan_in * SPARSE_DENSITY) ** 0.5
    return torch.where(keep, values, 0.0)  # +0.0, so that the zero runs compress


def _calibrate_batchnorm(model, calibration, gen) -> None:
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    for m in norms:
        m.reset_running_stats()
        m.momentum = 1.0
    model.train()
    model(calibration)
    for m in norms:
        m.momentum = 0.1
        std = m.running_var.sqrt()
        m.running_mean += 0.2 * std * torch.randn(std.shape, generator=gen)
        m.running_var *= torch.exp(torch.rand(std.shape, generator=gen) - 0.5)
    model.eval()


def images(gen: torch.Generator, batch: int, size: int, *, out_of_range: bool = False):
    """Normalised NCHW images of 8-bit pixels in [0.05, 0.95]: a bilinearly upsampled
    random colour field plus per-pixel texture; `out_of_range`: image 0 also holds a
    rectangle of 1.5*N(0, 1) values (as random erasing writes), so that the clamp binds."""
    field = torch.rand((batch, 3, 7, 7), generator=gen) * 0.7 + 0.15
    pixels = F.interpolate(field, size=(size, size), mode="bilinear", align_corners=False)
    pixels = pixels + 0.2 * (torch.rand((batch, 3, size, size), generator=gen) - 0.5)
    pixels = torch.round(pixels.clamp(0.05, 0.95) * 255) / 255
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
    x = (pixels - mean) / std
    if out_of_range:
        lo, hi = size // 8, size // 2
        x[0, :, lo:hi, lo:hi] = 1.5 * torch.randn((3, hi - lo, hi - lo), generator=gen)
    return x.float()


def clamp_limits():
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
    return (0 - mean) / std, (1 - mean) / std


def in_float64(build, state: dict) -> torch.nn.Module:
    """A float64 model with `state`, for the rounding estimate; convolutions and linear layers
    cast their input to float64 (FAN's Fourier encoding builds its grid in float32)."""
    double = build()
    double.load_state_dict(state, strict=True)
    double = double.double()
    for m in double.modules():
        if isinstance(m, torch.nn.Conv2d | torch.nn.Linear):
            m.register_forward_pre_hook(lambda m, i: (i[0].double(), *i[1:]))
    return double


def nhwc(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.transpose(a, (0, 2, 3, 1)))


def numpy_dict(tensors: dict) -> dict:
    return {k: v.detach().cpu().numpy() if torch.is_tensor(v) else v for k, v in tensors.items()}


# ------------------------------------------------------------------------------------------
# Forwards with their intermediates


def _capture(module, key, store, transform=lambda out: out):
    return module.register_forward_hook(lambda m, i, out: store.__setitem__(key, transform(out)))


def rvt_eval_outputs(model, x) -> dict:
    """Eval-mode logits, every block's output and the RVT debug aids."""
    store, hooks = {}, []
    blocks = [b for t in model.transformers for b in t.blocks]
    for i, block in enumerate(blocks):
        hooks.append(_capture(block, f"block_{i:02d}", store))
    hooks.append(_capture(model.patch_embed, "stem", store))
    for i, pool in enumerate(model.pools):
        hooks.append(_capture(pool, f"pool_{i:02d}", store))
    hooks.append(_capture(model.norm, "features", store))
    model.eval()
    with torch.no_grad():
        store["logits"] = model(x)
    for h in hooks:
        h.remove()
    return numpy_dict(store)


def rvt_block_modules(model, prefix="block") -> dict:
    return {
        f"{prefix}_{len_:02d}": name
        for len_, name in enumerate(
            f"transformers.{s}.blocks.{b}"
            for s, t in enumerate(model.transformers)
            for b in range(len(t.blocks))
        )
    }


def fan_eval_outputs(model, x) -> dict:
    """Eval-mode logits, every FAN block's and class-attention block's output, debug aids."""
    store, hooks = {}, []
    for i, block in enumerate(model.blocks):
        hooks.append(_capture(block, f"block_{i:02d}", store))
    for i, block in enumerate(model.cls_attn_blocks):
        hooks.append(_capture(block, f"cls_attn_block_{i:02d}", store))
    hooks.append(_capture(model.patch_embed, "patch_embed", store, lambda out: out[0]))
    hooks.append(
        model.patch_embed.proj.register_forward_pre_hook(
            lambda m, inputs: store.__setitem__("backbone_features", inputs[0])
        )
    )
    hooks.append(
        _capture(model.pos_embed, "pos_encoding", store, lambda p: p.flatten(2).transpose(1, 2)[0])
    )
    hooks.append(_capture(model.norm, "features", store, lambda out: out[:, 0]))
    model.eval()
    with torch.no_grad():
        store["logits"] = model(x)
    for h in hooks:
        h.remove()
    return numpy_dict(store)


def occlusion_forward(occ, x, noise):
    """C's forward as train_one_epoch_rspc runs it, keeping the STE's input and output."""
    store = {}
    hooks = [
        _capture(occ.relu, "patch_features", store, lambda out: out.flatten(1)),
        _capture(occ.fc, "scores", store),
        _capture(occ.ste, "patch_mask", store),
    ]
    mask = occ(x)
    for h in hooks:
        h.remove()
    for key in ("scores", "patch_mask"):
        store[key].retain_grad()
    lower, upper = clamp_limits()
    mixed = x * mask + noise * (1 - mask)
    corrupted = torch.max(torch.min(mixed, upper), lower)
    return dict(store, mask=mask, mixed=mixed, corrupted=corrupted)


# ------------------------------------------------------------------------------------------
# The cases


def classifier_case(name, build, kwargs, forward, image_size, gen, *, extra) -> dict:
    """A reduced classifier's eval fixture, checked by reloading into a fresh build."""
    torch.manual_seed(SEED)
    model = build()
    redraw(model, gen, images(gen, 4, image_size))
    x = images(gen, BATCH, image_size)
    outputs = forward(model, x)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.manual_seed(SEED + 1)
    fresh = build()
    fresh.load_state_dict(state, strict=True)
    assert_bitwise(forward(fresh, x), outputs, name)
    double = forward(in_float64(build, state), x.double())
    config = dict(
        extra,
        case=name,
        constructor=kwargs,
        init_policy=INIT_POLICY,
        inputs=_image_docs(["x"]),
        outputs=_array_docs(outputs),
        state_dict=_state_docs(state),
        num_parameters=sum(p.numel() for p in model.parameters()),
        float32_vs_float64_max_abs_diff=_max_diffs(outputs, double),
    )
    x = x.numpy()
    return dict(config=config, inputs=dict(x=x, x_nhwc=nhwc(x)), outputs=outputs, state=state)


def occlusion_case(official, gen) -> dict:
    """C's scores, mask, fold, clamped corrupted image and STE gradients of sum(corrupted*G)."""
    torch.manual_seed(SEED)
    _, _, patch, num_patches = OCCLUSION_ARGS
    size = int(num_patches**0.5) * patch
    occ = official.rvt.PatchOcclusion(*OCCLUSION_ARGS)
    for attempt in range(MAX_ATTEMPTS):  # noqa: B007 (recorded after the loop)
        x = images(gen, BATCH, size, out_of_range=True)
        noise = torch.rand(x.shape, generator=gen)
        g = 0.02 * torch.randn(x.shape, generator=gen)
        outputs, mixed = _occlusion_outputs(occ, x, noise, g)
        diagnostics = _occlusion_margins(outputs, mixed)
        if diagnostics["ok"]:
            break
    else:
        raise RuntimeError("no inputs with the required margins")
    state = {k: v.detach().clone() for k, v in occ.state_dict().items()}
    torch.manual_seed(SEED + 1)
    fresh = official.rvt.PatchOcclusion(*OCCLUSION_ARGS)
    fresh.load_state_dict(state, strict=True)
    assert_bitwise(_occlusion_outputs(fresh, x, noise, g)[0], outputs, "rspc_occlusion")
    double, _ = _occlusion_outputs(
        in_float64(lambda: official.rvt.PatchOcclusion(*OCCLUSION_ARGS), state),
        x.double(),
        noise.double(),
        g.double(),
    )
    inputs = {k: v.numpy() for k, v in dict(x=x, noise=noise, G=g).items()}
    inputs.update({f"{k}_nhwc": nhwc(v) for k, v in list(inputs.items())})
    config = dict(
        case="rspc_occlusion",
        kind="patch_occlusion",
        constructor=dict(
            callable="PatchOcclusion",
            source_file="RSPC_RVT/robust_models.py",
            args=OCCLUSION_ARGS,
            arg_names=["mask_ratio", "in_chans", "patch_size", "num_patches"],
        ),
        procedure=[
            "mask = occ(x)",
            "corrupted = max(min(x * mask + noise * (1 - mask), upper), lower)  # ImageNet limits",
            "f = sum(corrupted * G); f.backward()",
        ],
        init_policy="PyTorch's default initialisation (torch.manual_seed(0))",
        inputs=dict(
            _image_docs(["x"]),
            noise="U[0, 1) as torch.rand in the training loop, NCHW (+ noise_nhwc)",
            G="weights of the test objective f = sum(corrupted * G), NCHW (+ G_nhwc)",
        ),
        outputs=_array_docs(outputs),
        state_dict=_state_docs(state),
        float32_vs_float64_max_abs_diff=_max_diffs(outputs, double),
        diagnostics=dict(diagnostics, input_attempt=attempt),
    )
    return dict(config=config, inputs=inputs, outputs=outputs, state=state)


def _occlusion_outputs(occ, x, noise, g) -> dict:
    occ.train()
    params = list(occ.parameters())
    out = occlusion_forward(occ, x, noise)
    objective = (out["corrupted"] * g).sum()
    grads = torch.autograd.grad(objective, [*params, out["patch_mask"], out["scores"]])
    lower, upper = clamp_limits()
    result = dict(
        patch_features=out["patch_features"],
        scores=out["scores"],
        quantile=torch.quantile(out["scores"], OCCLUSION_ARGS[0] % 1, dim=1),
        patch_mask=out["patch_mask"],
        mask=out["mask"],
        corrupted=out["corrupted"],
        objective=objective,
        grad_patch_mask=grads[-2],
        grad_scores=grads[-1],
        clamp_lower=lower.flatten(),
        clamp_upper=upper.flatten(),
    )
    result.update({f"grad/{n}": gr for (n, _), gr in zip(occ.named_parameters(), grads)})
    result = numpy_dict(result)
    result["corrupted_nhwc"] = nhwc(result["corrupted"])
    return result, out["mixed"].detach().numpy()


def _occlusion_margins(outputs: dict, mixed: np.ndarray) -> dict:
    """Thresholds, clamp ties and hardtanh branches away from their decision points."""
    threshold = float(np.min(np.abs(outputs["scores"] - outputs["quantile"][:, None])))
    grad = np.abs(outputs["grad_patch_mask"])
    lower = outputs["clamp_lower"].reshape(1, 3, 1, 1)
    upper = outputs["clamp_upper"].reshape(1, 3, 1, 1)
    ties = int(np.sum((mixed == lower) | (mixed == upper)))
    clamped = float(np.mean((mixed < lower) | (mixed > upper)))
    branch = float(np.min(np.abs(grad - 1)))
    return dict(
        ok=threshold >= MARGIN and ties == 0 and clamped > 0 and branch >= MARGIN,
        threshold_margin=threshold,
        hardtanh_branch_margin=branch,
        fraction_grad_saturated=float(np.mean(grad > 1)),
        fraction_pixels_clamped=clamped,
        clamp_ties=ties,
        occluded_patches_per_image=[int(n) for n in (1 - outputs["patch_mask"]).sum(1)],
    )


# ------------------------------------------------------------------------------------------
# The RSPC training forward/backward


GRAD_PARAMS = [
    "patch_embed.proj.0.weight",
    "patch_embed.proj.1.weight",
    "patch_embed.proj.1.bias",
    "patch_embed.proj.3.weight",
    "transformers.0.blocks.0.attn.qkv.weight",
    "transformers.0.blocks.0.attn.qkv.bias",
    "transformers.0.blocks.0.mlp.dwconv.weight",
    "transformers.0.blocks.0.mlp.bn1.bias",
    "transformers.0.blocks.1.norm1.weight",
    "transformers.0.blocks.1.mlp.fc2.weight",
    "pools.0.conv.weight",
    "transformers.1.blocks.0.attn.proj.bias",
    "transformers.1.blocks.0.mlp.bn3.weight",
    "norm.weight",
    "norm.bias",
    "head.weight",
    "head.bias",
]


def soft_targets(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    from timm.data.mixup import mixup_target

    return mixup_target(labels, num_classes, lam=0.7, smoothing=0.1)


def rspc_step_outputs(official, model, occ, x, noise, targets) -> dict:
    """train_one_epoch_rspc's forward and backward on one batch (no optimizer step), and the
    backward again on LOSS_SCALE * loss for C's gradients under the AMP loss scaler; with
    the pre-clamp mix and the stem max-pool's input, for the margins."""
    from timm.loss import SoftTargetCrossEntropy

    model.train()
    occ.train()
    criterion = official.losses.DistillationLoss(SoftTargetCrossEntropy(), None, "none", 0.5, 1.0)
    store, hooks = {}, []
    blocks = [b for t in model.transformers for b in t.blocks]
    for i, block in enumerate(blocks):
        hooks.append(_capture(block, f"train_block_{i:02d}", store))
    stem_pool = model.patch_embed.proj[2]
    pooled = {}
    hooks.append(stem_pool.register_forward_pre_hook(lambda m, i: pooled.update(input=i[0])))
    out = occlusion_forward(occ, x, noise)
    logits_corrupted, logits_clean = model(out["corrupted"], x)
    for h in hooks:
        h.remove()
    loss_ce = criterion(x, logits_clean, targets)
    loss_align = official.utils.FeatureAlignmentLoss(model)
    loss_total = loss_ce + RSPC_LAMBDA * loss_align
    named = dict(model.named_parameters())
    occ_named = dict(occ.named_parameters())
    wrt = [named[n] for n in GRAD_PARAMS] + list(occ_named.values())
    wrt += [out["patch_mask"], out["scores"]]
    grads = torch.autograd.grad(loss_total, wrt, retain_graph=True)
    scaled = torch.autograd.grad(LOSS_SCALE * loss_total, wrt[len(GRAD_PARAMS) :])
    result = dict(
        patch_scores=out["scores"],
        patch_mask=out["patch_mask"],
        corrupted=out["corrupted"],
        logits_corrupted=logits_corrupted,
        logits_clean=logits_clean,
        loss_ce=loss_ce,
        loss_align=loss_align,
        loss_total=loss_total,
        grad_patch_mask=grads[-2],
        grad_scores=grads[-1],
        grad_patch_mask_scaled=scaled[-2],
        grad_scores_scaled=scaled[-1],
        **store,
    )
    result.update({f"recon_loss_block_{i:02d}": b.recon_loss for i, b in enumerate(blocks)})
    result.update({f"grad/{n}": g for n, g in zip(GRAD_PARAMS, grads)})
    for (n, _), g, s in zip(occ_named.items(), grads[len(GRAD_PARAMS) :], scaled):
        result[f"occlusion_grad/{n}"] = g
        result[f"occlusion_grad_scaled/{n}"] = s
    for name, buf in model.state_dict().items():
        if any(name.endswith(s) for s in ("running_mean", "running_var", "num_batches_tracked")):
            result[f"bn_after/{name}"] = buf.clone()
    extras = dict(mixed=out["mixed"], maxpool_input=pooled["input"])
    return numpy_dict(result), numpy_dict(extras)


def rspc_loss_case(official, gen) -> dict:
    """One RSPC training forward/backward of the reduced RVT-Ti*-structured classifier with C."""
    image_size = RVT_TRAIN["image_size"]

    def build():
        return official.rvt.PoolingTransformer(**RVT_TRAIN), official.rvt.PatchOcclusion(
            *OCCLUSION_ARGS
        )

    torch.manual_seed(SEED)
    model, occ = build()
    redraw(model, gen, images(gen, 4, image_size))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    occ_state = {k: v.detach().clone() for k, v in occ.state_dict().items()}
    for attempt in range(MAX_ATTEMPTS):  # noqa: B007 (recorded after the loop)
        x = images(gen, BATCH, image_size, out_of_range=True)
        noise = torch.rand(x.shape, generator=gen)
        labels = torch.randint(0, RVT_TRAIN["num_classes"], (BATCH,), generator=gen)
        targets = soft_targets(labels, RVT_TRAIN["num_classes"])
        model.load_state_dict(state)
        outputs, extras = rspc_step_outputs(official, model, occ, x, noise, targets)
        diagnostics = _rspc_margins(outputs, extras, occ_ratio=OCCLUSION_ARGS[0] % 1)
        if diagnostics["ok"]:
            break
    else:
        raise RuntimeError("no inputs with the required margins")
    torch.manual_seed(SEED + 1)
    fresh, fresh_occ = build()
    fresh.load_state_dict(state, strict=True)
    fresh_occ.load_state_dict(occ_state, strict=True)
    again, _ = rspc_step_outputs(official, fresh, fresh_occ, x, noise, targets)
    assert_bitwise(again, outputs, "rspc_loss_rvt")
    double, _ = rspc_step_outputs(
        official,
        in_float64(lambda: build()[0], state),
        in_float64(lambda: build()[1], occ_state),
        x.double(),
        noise.double(),
        targets.double(),
    )
    inputs = dict(x=x.numpy(), noise=noise.numpy())
    inputs.update({f"{k}_nhwc": nhwc(v) for k, v in list(inputs.items())})
    inputs.update(labels=labels.numpy(), targets=targets.numpy())
    config = dict(
        case="rspc_loss_rvt",
        kind="rspc_loss",
        classifier=dict(
            callable="PoolingTransformer",
            source_file="RSPC_RVT/robust_models.py",
            kwargs=RVT_TRAIN,
            state_dict_file="state_dict.npz",
        ),
        occlusion_model=dict(
            callable="PatchOcclusion",
            source_file="RSPC_RVT/robust_models.py",
            args=OCCLUSION_ARGS,
            state_dict_file="occlusion_state_dict.npz",
        ),
        procedure=[
            "model.train(); occ.train()   # dropout / drop-path rates are 0: deterministic",
            "mask = occ(x)",
            "corrupted = max(min(x * mask + noise * (1 - mask), upper), lower)",
            "logits_corrupted, logits_clean = model(corrupted, x)   # one forward of cat([corrupted, x])",
            "loss_ce = criterion(x, logits_clean, targets)",
            "loss_align = utils.FeatureAlignmentLoss(model)   # sum of block mse / (n_blocks + 1e-4)",
            "loss_total = loss_ce + extra_weight * loss_align",
            "gradients of loss_total; C's again of loss_scale_for_extra * loss_total (*_scaled)",
        ],
        extra_weight=RSPC_LAMBDA,
        loss=dict(
            criterion='DistillationLoss(SoftTargetCrossEntropy(), None, "none", 0.5, 1.0)',
            targets="timm mixup_target(labels, num_classes, lam=0.7, smoothing=0.1)",
        ),
        target_type="soft",
        grad_params=GRAD_PARAMS,
        loss_scale_for_extra=LOSS_SCALE,
        init_policy=INIT_POLICY,
        block_modules=rvt_block_modules(model, "train_block"),
        inputs=dict(_image_docs(["x"]), noise="U[0, 1) as torch.rand, NCHW (+ noise_nhwc)"),
        outputs=_array_docs(outputs),
        state_dict=_state_docs(state),
        occlusion_state_dict=_state_docs(occ_state),
        float32_vs_float64_max_abs_diff=_max_diffs(outputs, double),
        diagnostics=dict(diagnostics, input_attempt=attempt),
    )
    return dict(config=config, inputs=inputs, outputs=outputs, state=state, occ_state=occ_state)


def _rspc_margins(outputs: dict, extras: dict, occ_ratio: float) -> dict:
    scores = outputs["patch_scores"]
    quantile = np.quantile(scores.astype(np.float64), occ_ratio, axis=1)[:, None]
    threshold = float(np.min(np.abs(scores - quantile)))
    lower, upper = (limit.numpy() for limit in clamp_limits())
    ties = int(np.sum((extras["mixed"] == lower) | (extras["mixed"] == upper)))
    scaled = float(np.min(np.abs(outputs["grad_patch_mask_scaled"])))
    unscaled = float(np.min(np.abs(np.abs(outputs["grad_patch_mask"]) - 1)))
    gap = _maxpool_gap(extras["maxpool_input"])
    return dict(
        ok=threshold >= MARGIN
        and ties == 0
        and scaled > 1.01
        and unscaled >= MARGIN
        and gap >= MAXPOOL_GAP,
        threshold_margin=threshold,
        clamp_ties=ties,
        min_abs_scaled_patch_grad=scaled,
        unscaled_hardtanh_branch_margin=unscaled,
        maxpool_min_top2_gap=gap,
    )


def _maxpool_gap(pool_input: np.ndarray) -> float:
    """The smallest gap between the two largest inputs of any window of the stem's
    MaxPool2d(3, stride 2, padding 1), on the batch the train forward saw."""
    padded = F.pad(torch.from_numpy(pool_input), (1, 1, 1, 1), value=-np.inf)
    windows = F.unfold(padded.flatten(0, 1)[:, None], kernel_size=3, stride=2)
    top2 = torch.topk(windows, 2, dim=1).values
    return float((top2[:, 0] - top2[:, 1]).min())


def assert_bitwise(ours: dict, ref: dict, name: str) -> None:
    assert set(ours) == set(ref), f"{name}: {sorted(set(ours) ^ set(ref))}"
    for key in ref:
        assert np.array_equal(ours[key], ref[key]), f"{name}: {key} differs after reloading"


# ------------------------------------------------------------------------------------------
# Docs of arrays


def _image_docs(keys) -> dict:
    return {
        k: "random 8-bit RGB images in [0.05, 0.95] (upsampled 7x7 colour field plus texture), "
        f"ImageNet-normalised, NCHW; {k}_nhwc: the same in NHWC"
        for k in keys
    }


def _array_docs(arrays: dict) -> dict:
    return {
        k: dict(shape=list(np.shape(v)), dtype=str(np.asarray(v).dtype)) for k, v in arrays.items()
    }


def _state_docs(state: dict) -> dict:
    entries = [[k, list(v.shape), str(v.dtype).replace("torch.", "")] for k, v in state.items()]
    return dict(num_entries=len(entries), entries=entries)


def _max_diffs(single: dict, double: dict) -> dict:
    return {
        k: float(np.max(np.abs(np.asarray(single[k], np.float64) - np.asarray(double[k]))))
        for k in single
        if np.asarray(single[k]).dtype == np.float32 and k in double
    }


# ------------------------------------------------------------------------------------------
# The cases and their files


KINDS = {
    "rvt_classifier": "eval-mode forward of a reduced RVT* (PoolingTransformer): logits and block outputs",
    "fan_classifier": "eval-mode forward of a reduced FAN-Hybrid: logits and FAN block outputs",
    "patch_occlusion": "RSPC patch-occlusion model C, corrupted image and straight-through gradients",
    "rspc_loss": "one RSPC train-mode forward/backward: CE, alignment loss, total loss, gradients",
    "rspc_trajectory": "50 official RSPC training steps of a tiny RVT on the digits (float32, "
    "with the float64 envelope): per-step scalars and masks, initial and final weights",
}


def rvt_case(official, gen, name, kwargs, variant, covers, omit=()) -> dict:
    """A reduced RVT* case; `omit`: debug aids left out (large at width 768)."""
    spec = dict(
        callable="PoolingTransformer", source_file="RSPC_RVT/robust_models.py", kwargs=kwargs
    )
    case = classifier_case(
        name,
        lambda: official.rvt.PoolingTransformer(**kwargs),
        spec,
        rvt_eval_outputs,
        kwargs["image_size"],
        gen,
        extra=dict(kind="rvt_classifier", official_variant=variant, covers=covers),
    )
    case["config"]["block_modules"] = rvt_block_modules(official.rvt.PoolingTransformer(**kwargs))
    for key in omit:
        del case["outputs"][key], case["config"]["outputs"][key]
        del case["config"]["float32_vs_float64_max_abs_diff"][key]
    return case


def fan_case(official, gen) -> dict:
    spec = dict(
        backbone=dict(
            callable="_create_hybrid_backbone",
            source_file="RSPC_FAN/models/convnext_utils.py",
            kwargs=FAN_BACKBONE,
        ),
        callable="FAN",
        source_file="RSPC_FAN/models/fan.py",
        kwargs=FAN_KWARGS,
    )

    def build():
        backbone = official.convnext._create_hybrid_backbone(**FAN_BACKBONE)
        return official.fan.FAN(backbone=backbone, **FAN_KWARGS)

    case = classifier_case(
        "fan_t_hybrid_reduced",
        build,
        spec,
        fan_eval_outputs,
        FAN_KWARGS["img_size"],
        gen,
        extra=dict(
            kind="fan_classifier",
            official_variant="fan_tiny_8_p4_hybrid",
            covers="ConvNeXt stem (depths [1, 1]), HybridEmbed 2x2/2, Fourier positional "
            "encoding, 2 FAN blocks (token mixing, channel processing with BatchNorm), "
            "2 class-attention blocks with tokens_norm",
        ),
    )
    depth, cls_layers = FAN_KWARGS["depth"], FAN_KWARGS["cls_attn_layers"]
    case["config"]["block_modules"] = {f"block_{i:02d}": f"blocks.{i}" for i in range(depth)}
    case["config"]["cls_attn_block_modules"] = {
        f"cls_attn_block_{i:02d}": f"cls_attn_blocks.{i}" for i in range(cls_layers)
    }
    return case


def trajectory_case(official) -> dict:
    """reference/trajectory.py's comparison for 50 steps of a width-48 two-block RVT (the
    trajectory's own initialisation and batches), as a case."""
    import trajectory

    args = trajectory.parse_args(
        ["--official_repo", str(official.repo), "--steps", "50", "--seed", "0", "--out", "-"]
        + ["--base_dim", "16", "--depth", "2", "--heads", "3", "--probe_steps"]
    )
    result, comparison = trajectory.run(args)
    return trajectory.fixture_case(args, result, comparison)


CASES = ("rvt_ti_plus_reduced", "rvt_b_plus_reduced", "fan_t_hybrid_reduced")
CASES += ("rspc_occlusion", "rspc_loss_rvt", "rspc_trajectory_rvt")


def build_cases(official, names) -> Iterator[dict]:
    """The cases called `names`, in CASES order. The synthetic cases draw from one generator
    in turn, so each is drawn as if all were (and discarded when not asked for)."""
    if "rspc_trajectory_rvt" in names:
        yield trajectory_case(official)
    if not set(names) - {"rspc_trajectory_rvt"}:
        return
    gen = torch.Generator().manual_seed(SEED)
    synthetic = [
        rvt_case(
            official,
            gen,
            "rvt_ti_plus_reduced",
            RVT_TI,
            "rvt_tiny_plus",
            "conv stem, PAAS in every stage-0 block, conv-MLP with BatchNorm, depthwise "
            "pooling, a second stage without PAAS",
        ),
        rvt_case(
            official,
            gen,
            "rvt_b_plus_reduced",
            RVT_B,
            "rvt_base_plus",
            "width 768 (the Linear MLP path, no BatchNorm in blocks), PAAS in block 0 only",
            omit=("stem",),
        ),
        fan_case(official, gen),
        occlusion_case(official, gen),
        rspc_loss_case(official, gen),
    ]
    yield from (case for case in synthetic if case["config"]["case"] in names)


def write_case(case: dict, root: pathlib.Path, provenance: dict) -> dict:
    config = case["config"]
    folder = root / config["case"]
    folder.mkdir(parents=True, exist_ok=True)
    config = {**dict(seed=SEED, batch=BATCH, dtype="float32"), **provenance, **config}
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    np.savez_compressed(folder / "inputs.npz", **case["inputs"])
    np.savez_compressed(folder / "outputs.npz", **case["outputs"])
    np.savez_compressed(folder / "state_dict.npz", **numpy_dict(case["state"]))
    if "occ_state" in case:
        np.savez_compressed(folder / "occlusion_state_dict.npz", **numpy_dict(case["occ_state"]))
    files = sorted(p.name for p in folder.iterdir())
    return dict(
        name=config["case"],
        kind=config["kind"],
        batch=config["batch"],
        files=files,
        size_bytes=sum((folder / f).stat().st_size for f in files),
    )


# ------------------------------------------------------------------------------------------
# Full-size key manifests


def manifest_builders(official) -> dict:
    """Full-size models whose state-dict keys the layout tests compare with ours."""
    import timm

    rvt = {n: (lambda n=n: getattr(official.rvt, n)(pretrained=False)) for n in RVT_VARIANTS}
    fan = {n: (lambda n=n: getattr(official.fan, n)(pretrained=False)) for n in FAN_VARIANTS}
    # fan_tiny_12_p16_224 names a default_cfgs entry that fan.py does not define
    fan["fan_tiny_12_p16_224"] = lambda: official.fan.fan_tiny_12_p16_224(
        pretrained=False, default_cfg=official.fan._cfg()
    )
    lib = {n: (lambda n=n: timm.create_model(n, pretrained=False)) for n in TIMM_VARIANTS}
    return {**rvt, **fan, **lib}


RVT_VARIANTS = (
    "rvt_tiny",
    "rvt_tiny_plus",
    "rvt_small",
    "rvt_small_plus",
    "rvt_base",
    "rvt_base_plus",
)
FAN_VARIANTS = (
    "fan_tiny_8_p4_hybrid",
    "fan_small_12_p4_hybrid",
    "fan_base_16_p4_hybrid",
    "fan_large_16_p4_hybrid",
    "fan_tiny_12_p16_224",
    "fan_small_12_p16_224",
)
TIMM_VARIANTS = (
    "deit_tiny_patch16_224",
    "deit_small_patch16_224",
    "deit_base_patch16_224",
    "xcit_nano_12_p16_224",
    "xcit_tiny_12_p16_224",
    "xcit_small_12_p16_224",
    "xcit_medium_24_p16_224",
)


def write_manifests(official, root: pathlib.Path, provenance: dict) -> None:
    """[key, shape, dtype] of every state-dict entry and the parameter counts."""
    root.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, build in manifest_builders(official).items():
        model = build()
        state = model.state_dict()
        entry = dict(
            num_parameters=sum(p.numel() for p in model.parameters()),
            num_state_dict_entries=len(state),
            state_dict_numel=sum(v.numel() for v in state.values()),
        )
        manifest = dict(
            model=name,
            provenance=provenance,
            num_classes=1000,
            **entry,
            format="entries = [key, shape, dtype] in model.state_dict() order; no weights",
            entries=_state_docs(state)["entries"],
        )
        (root / f"{name}.json").write_text(json.dumps(manifest) + "\n")
        counts[name] = entry
    params = dict(
        description="Parameter counts (model.parameters(), buffers excluded) of the full-size "
        "models, 1000 classes; one <model>.json per model lists its state-dict entries.",
        provenance=provenance,
        models=counts,
    )
    (root / "params.json").write_text(json.dumps(params, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--official_repo", required=True, type=pathlib.Path, help="guoyongcs/RSPC checkout"
    )
    parser.add_argument("--out", type=pathlib.Path, default=OUT, help="default: tests/fixtures")
    parser.add_argument(
        "--cases",
        nargs="+",
        choices=CASES,
        default=CASES,
        help="rewrite only these cases (the others keep their index entries and files); "
        "the key manifests are written only when every case is",
    )
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    official = Official(args.official_repo.resolve())
    provenance = dict(
        reference=dict(repo="guoyongcs/RSPC", commit=official.commit()),
        generator="reference/make_fixtures.py",
        software=software(),
    )
    reference = args.out / "reference"
    written = {
        c["name"]: c
        for c in (
            write_case(case, reference, provenance) for case in build_cases(official, args.cases)
        )
    }
    kept = (
        json.loads((reference / "index.json").read_text())["cases"]
        if set(args.cases) < set(CASES)
        else []
    )
    kept = {c["name"]: c for c in kept}
    index = [written.get(name) or kept[name] for name in CASES if name in written or name in kept]
    (reference / "index.json").write_text(
        json.dumps(
            dict(format_version=1, seed=SEED, kinds=KINDS, cases=index, **provenance), indent=1
        )
        + "\n"
    )
    if set(args.cases) == set(CASES):
        write_manifests(official, args.out / "torch_keys", provenance)
    total = sum(case["size_bytes"] for case in index)
    print(json.dumps(dict(cases={c["name"]: c["size_bytes"] for c in index}, total_bytes=total)))


if __name__ == "__main__":
    main()
