"""The official RVT training step, timed as `benchmarks.measure` times ours, for the
side-by-side comparison of `python -m benchmarks.train_step --compare_command`.

    python benchmarks/official_step.py rspc 5 --official_repo ../RSPC
    python -m benchmarks.train_step --config=configs/rvt_ti.py --config.patch_aug=off --batch=8 \\
        --steps=5 --compare_command="plain=python benchmarks/official_step.py plain {steps}" \\
        --compare_command="rspc=python benchmarks/official_step.py rspc {steps}"

Run under a Python with PyTorch and timm, and a checkout of guoyongcs/RSPC (`--official_repo`,
or the environment variable RSPC_OFFICIAL_REPO). It builds the official `rvt_tiny_plus`
(RSPC_RVT/robust_models.py; drop path 0.1 as main.py's default) and, for `rspc`, the official
C (`PatchOcclusion(0.1, 3, 16, 196)`), and runs one step per call exactly as the official loop
does with --use_patch_aug off: `rspc` restates `engine.train_one_epoch_rspc` call by call (C's
mask, noise, clamp, one forward of [corrupted; clean], the criterion, λ·FeatureAlignmentLoss,
timm's NativeScaler backward and AdamW step, C's gradient clipped to 5, reversed, C's
Nesterov SGD step), `plain` restates `engine.train_one_epoch`; both mix the batch with timm's
Mixup (main.py's defaults) into soft targets for SoftTargetCrossEntropy under the official
DistillationLoss, and update the EMA (main.py's default ModelEmaV2, 0.99996). The step runs in
float32 unless `--autocast` names a dtype: the official loop runs C, the corruption, the
forward and the losses under `torch.cuda.amp.autocast` (float16) for every model but RVT-B;
`--autocast bfloat16` times it as our bfloat16 step computes. It is blocked per step. On a
GPU the official loop's NativeScaler multiplies the loss by its scale (2^16 at the start) before the backward: the classifier's gradients are
unscaled before its update, C's are not, and its straight-through hardtanh acts on the scaled
ones. On CPU timm's default scaler is disabled, so this script gives NativeScaler the step's
own device: the scaler then works on CPU as the official one does on a GPU (`--loss_scale 0`
turns it off). The batch is one random batch, mixed afresh each step as the loop mixes each
batch. The last line printed is the JSON record that `--compare_command` reads.
"""

import argparse
import importlib
import json
import os
import pathlib
import statistics
import sys

if not __package__:  # run as a file: the repository root holds the benchmarks package
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import timing  # noqa: E402 (after the path above)

REPO_ENV = "RSPC_OFFICIAL_REPO"
# RSPC_RVT/main.py's defaults for the RVT recipe.
OFFICIAL = dict(
    model="rvt_tiny_plus",
    drop_path=0.1,
    lr=5e-4,  # scaled by batch / 512 as main.py does
    weight_decay=0.05,
    smoothing=0.1,
    mixup=0.8,
    cutmix=1.0,
    mixup_prob=1.0,
    switch_prob=0.5,
    ema_decay=0.99996,
    occlusion_ratio=0.1,
    extra_weight=0.005,
    occlusion_clip=5.0,
    occlusion_lr=1e-4,
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variant", choices=("plain", "rspc"))
    parser.add_argument("steps", type=int, help="timed steps (after one warm-up step)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument(
        "--model", default=OFFICIAL["model"], help="an official RVT* model, e.g. rvt_small_plus"
    )
    parser.add_argument("--num_classes", type=int, default=1000)
    parser.add_argument("--official_repo", type=pathlib.Path, default=os.environ.get(REPO_ENV))
    parser.add_argument("--mixup", type=float, default=OFFICIAL["mixup"], help="0: off")
    parser.add_argument("--cutmix", type=float, default=OFFICIAL["cutmix"], help="0: off")
    parser.add_argument("--ema_decay", type=float, default=OFFICIAL["ema_decay"], help="0: off")
    parser.add_argument(
        "--loss_scale", type=float, default=2.0**16, help="the scaler's initial scale; 0: off"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--autocast",
        choices=("off", "float16", "bfloat16"),
        default="off",
        help="the dtype of the official loop's autocast region (it uses float16 on CUDA)",
    )
    parser.add_argument("--threads", type=int, default=0, help="0: every usable core")
    args = parser.parse_args(argv)
    if args.official_repo is None:
        parser.error(f"pass --official_repo or set {REPO_ENV} (a checkout of guoyongcs/RSPC)")
    check_official_repo(parser, args.official_repo)
    return args


def check_official_repo(parser: argparse.ArgumentParser, repo: pathlib.Path) -> None:
    """Stops with the usage when `repo` is not a checkout of guoyongcs/RSPC."""
    if not (repo / "RSPC_RVT" / "robust_models.py").is_file():
        parser.error(f"{repo} holds no RSPC_RVT/robust_models.py (a checkout of guoyongcs/RSPC)")


def official_modules(repo: pathlib.Path):
    """RSPC_RVT's robust_models, utils and losses (imported from the checkout)."""
    sys.path.insert(0, str(repo.resolve() / "RSPC_RVT"))
    return tuple(importlib.import_module(m) for m in ("robust_models", "utils", "losses"))


def rspc_forward(torch, model, occlusion, samples, noise, lower, upper):
    """train_one_epoch_rspc's forward without patch aug: C's keep mask, the noise blended
    into the occluded patches and clamped, one forward of [corrupted; clean]. Returns
    (C's mask, the outputs on the clean half)."""
    noise_mask = occlusion(samples)
    noise_sample = samples * noise_mask + noise * (1 - noise_mask)
    noise_sample = torch.max(torch.min(noise_sample, upper), lower)
    _, outputs = model(noise_sample, samples)
    return noise_mask, outputs


class OfficialStep:
    """The official model, C, optimizers, scaler, EMA and criterion, and one step of them."""

    def __init__(self, args):
        from timm.data import Mixup
        from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
        from timm.optim import create_optimizer_v2
        from timm.utils import ModelEmaV2, NativeScaler
        import torch

        self.torch = torch
        self.args = args
        robust_models, self.utils, losses = official_modules(args.official_repo)
        device = torch.device(args.device)
        self.model = getattr(robust_models, args.model)(
            pretrained=False,
            num_classes=args.num_classes,
            drop_rate=0.0,
            drop_path_rate=OFFICIAL["drop_path"],
        ).to(device)
        lr = OFFICIAL["lr"] * args.batch / 512.0
        self.optimizer = create_optimizer_v2(
            self.model, opt="adamw", lr=lr, weight_decay=OFFICIAL["weight_decay"]
        )
        self.scaler = NativeScaler(device=device.type)
        self.scaler._scaler = torch.amp.GradScaler(
            device.type, init_scale=args.loss_scale or 1.0, enabled=args.loss_scale > 0
        )
        self.ema = ModelEmaV2(self.model, decay=args.ema_decay) if args.ema_decay > 0 else None
        self.model.train()  # as the loop sets it once per epoch
        self.mixing = args.mixup > 0 or args.cutmix > 0
        self.mix = Mixup(
            mixup_alpha=args.mixup,
            cutmix_alpha=args.cutmix,
            prob=OFFICIAL["mixup_prob"],
            switch_prob=OFFICIAL["switch_prob"],
            label_smoothing=OFFICIAL["smoothing"],
            num_classes=args.num_classes,
        )
        base = (
            SoftTargetCrossEntropy()
            if self.mixing
            else LabelSmoothingCrossEntropy(smoothing=OFFICIAL["smoothing"])
        )
        self.criterion = losses.DistillationLoss(base, None, "none", 0.5, 1.0)
        self.occlusion = None
        if args.variant == "rspc":
            self.occlusion = robust_models.PatchOcclusion(
                OFFICIAL["occlusion_ratio"], 3, 16, 196
            ).to(device)
            self.occlusion_optimizer = torch.optim.SGD(
                self.occlusion.parameters(),
                momentum=0.9,
                nesterov=True,
                lr=OFFICIAL["occlusion_lr"],
                weight_decay=0.05,
            )
        mean = torch.tensor((0.485, 0.456, 0.406), device=device).view(3, 1, 1)
        std = torch.tensor((0.229, 0.224, 0.225), device=device).view(3, 1, 1)
        self.lower, self.upper = (0 - mean) / std, (1 - mean) / std
        self.images = torch.randn(args.batch, 3, 224, 224, device=device)
        self.labels = torch.randint(0, args.num_classes, (args.batch,), device=device)

    def autocast(self):
        """The official loop's autocast region, in `--autocast`'s dtype (or none)."""
        torch, dtype = self.torch, self.args.autocast
        device = torch.device(self.args.device).type
        if dtype == "off":
            return torch.autocast(device, enabled=False)
        return torch.autocast(device, dtype=getattr(torch, dtype))

    def loss(self, samples, targets):
        """The official loop's forward and loss (inside its autocast region)."""
        torch = self.torch
        if self.occlusion is None:
            return self.criterion(samples, self.model(samples), targets)
        noise = torch.rand(samples.shape, dtype=samples.dtype, device=samples.device)
        _, outputs = rspc_forward(
            torch, self.model, self.occlusion, samples, noise, self.lower, self.upper
        )
        loss = self.criterion(samples, outputs, targets)
        return loss + OFFICIAL["extra_weight"] * self.utils.FeatureAlignmentLoss(self.model)

    def __call__(self) -> float:
        """One step of the official loop; returns loss.item() as the loop reads it."""
        torch, args = self.torch, self.args
        samples, targets = self.images, self.labels
        if self.mixing:
            samples, targets = self.mix(samples.clone(), targets)  # a fresh batch, mixed
        with self.autocast():
            loss = self.loss(samples, targets)
        loss_value = loss.item()
        self.optimizer.zero_grad()
        if self.occlusion is not None:
            self.occlusion_optimizer.zero_grad()
        self.scaler(loss, self.optimizer, clip_grad=None, parameters=self.model.parameters())
        if self.occlusion is not None:
            torch.nn.utils.clip_grad_norm_(self.occlusion.parameters(), OFFICIAL["occlusion_clip"])
            self.utils.reverse_grad(self.occlusion_optimizer)
            self.occlusion_optimizer.step()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        if self.ema is not None:
            self.ema.update(self.model)
        return loss_value


def time_official_step(args) -> dict:
    """The step's times and this process's peak memory, as the JSON record expects."""
    import timm
    import torch

    torch.set_num_threads(args.threads or timing.usable_cores())
    torch.manual_seed(0)
    step = OfficialStep(args)
    step()  # warm-up: first-run allocations
    times, cores_busy = timing.time_calls(step, args.steps)
    on_gpu = args.device.startswith("cuda")
    return dict(
        framework=f"PyTorch {torch.__version__}, timm {timm.__version__} (official RSPC code)",
        variant=args.variant,
        autocast=args.autocast,
        median_sec=statistics.median(times),
        times=times,
        peak_rss_bytes=timing.peak_rss_bytes(),
        peak_device_bytes=torch.cuda.max_memory_allocated() if on_gpu else None,
        cores_busy=cores_busy,
        batch=args.batch,
        mixup=step.mixing,
        ema=step.ema is not None,
        loss_scale=step.scaler._scaler.get_scale() if args.loss_scale > 0 else None,
        num_parameters=sum(p.numel() for p in step.model.parameters()),
    )


def main(argv=None) -> None:
    print(json.dumps(time_official_step(parse_args(argv))))


if __name__ == "__main__":
    main()
