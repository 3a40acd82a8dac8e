"""timm's train step of a model, timed as `benchmarks.measure` times ours, for the
side-by-side comparison of `python -m benchmarks.train_step --compare_timm`.

    python -m benchmarks.timm_step --model=deit_small_patch16_224 --batch=8 --steps=5

One step is what our plain step does for a ViT/DeiT or XCiT config: Mixup/CutMix of the
batch when an alpha is positive (timm's `Mixup`, which timm's and the official training loops
apply to each batch), a train-mode forward (drop path), soft-target cross-entropy with label
smoothing, backward, AdamW, and the EMA update when `--ema_decay` > 0 (timm's ModelEmaV2).
`--device=cuda` runs it on the GPU, each step synchronised, and `--bfloat16` under
bfloat16 autocast (as our `compute_dtype=bfloat16` step). It runs in its own process so that
its peak memory (VmHWM, and the GPU allocator's peak) is its own; the last line printed is a
JSON record.
"""

import contextlib
import functools
import json
import statistics

from absl import app, flags

from benchmarks import timing


def time_timm_step(
    model_name: str,
    *,
    batch: int,
    image_size: int,
    num_classes: int,
    steps: int,
    drop_path: float,
    label_smoothing: float,
    ema_decay: float,
    mixup_alpha: float = 0.0,
    cutmix_alpha: float = 0.0,
    mixup_prob: float = 1.0,
    switch_prob: float = 0.5,
    threads: int = 0,
    device: str = "cpu",
    bfloat16: bool = False,
) -> dict:
    """Median seconds of timm's train step and this process's peak RSS (and GPU memory)."""
    torch, timm = _libraries(model_name, device)
    torch.set_num_threads(threads or timing.usable_cores())
    torch.manual_seed(0)
    model = timm.create_model(
        model_name, num_classes=num_classes, drop_path_rate=drop_path, img_size=image_size
    )
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    ema = timm.utils.ModelEmaV2(model, decay=ema_decay) if ema_decay > 0 else None
    images = torch.randn(batch, 3, image_size, image_size, device=device)
    labels = torch.randint(0, num_classes, (batch,), device=device)
    off = label_smoothing / num_classes
    targets = torch.full((batch, num_classes), off, device=device).scatter_(
        1, labels[:, None], 1.0 - label_smoothing + off
    )
    on_gpu = device.startswith("cuda")
    autocast = (
        functools.partial(torch.autocast, device.split(":")[0], dtype=torch.bfloat16)
        if bfloat16
        else contextlib.nullcontext
    )
    mixing = mixup_alpha > 0 or cutmix_alpha > 0
    if mixing:
        from timm.data import Mixup

        mix = Mixup(
            mixup_alpha=mixup_alpha,
            cutmix_alpha=cutmix_alpha,
            prob=mixup_prob,
            switch_prob=switch_prob,
            label_smoothing=label_smoothing,
            num_classes=num_classes,
        )

    def step():
        nonlocal images, targets
        if mixing:  # in place, like the training loops; the work is the same on mixed images
            images, targets = mix(images, labels)
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            logits = model(images)
        loss = torch.sum(-targets * torch.log_softmax(logits.float(), dim=-1), dim=-1).mean()
        loss.backward()
        optimizer.step()
        if ema is not None:
            ema.update(model)
        if on_gpu:  # kernels run asynchronously: a step ends when the GPU is done
            torch.cuda.synchronize()
        return loss

    step()  # warm-up: first-run allocations
    times, cores_busy = timing.time_calls(step, steps)
    return dict(
        framework=f"PyTorch {torch.__version__}, timm {timm.__version__}",
        median_sec=statistics.median(times),
        times=times,
        peak_rss_bytes=timing.peak_rss_bytes(),
        peak_device_bytes=torch.cuda.max_memory_allocated() if on_gpu else None,
        cores_busy=cores_busy,
        mixup=mixing,
        num_parameters=sum(p.numel() for p in model.parameters()),
    )


def _libraries(model_name: str, device: str):
    """torch and timm, checked: both installed, `device` one torch can run on here, and
    `model_name` one of timm's models."""
    try:
        import timm
        import timm.utils
        import torch
    except ImportError as error:
        raise SystemExit(
            f"timm and torch are needed for the comparison ({error}); "
            "pip install -r requirements-torch.txt"
        ) from None
    if device != "cpu" and not (device.startswith("cuda") and torch.cuda.is_available()):
        choices = "--device=cpu or --device=cuda" if torch.cuda.is_available() else "--device=cpu"
        raise SystemExit(
            f"--device={device} is not a device torch can run on here"
            f"{'' if torch.cuda.is_available() else ' (it sees no CUDA GPU)'}: pass {choices}"
        )
    if not timm.is_model(model_name):
        raise SystemExit(
            f"{model_name} is not a timm model, so there is no timm step to compare with; "
            "--compare_timm covers the ViT/DeiT and XCiT configs (for RVT and FAN, time the "
            "official code with --compare_command)"
        )
    return torch, timm


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    f = flags.FLAGS
    result = time_timm_step(
        f.model,
        batch=f.batch,
        image_size=f.image_size,
        num_classes=f.num_classes,
        steps=f.steps,
        drop_path=f.drop_path,
        label_smoothing=f.label_smoothing,
        ema_decay=f.ema_decay,
        mixup_alpha=f.mixup_alpha,
        cutmix_alpha=f.cutmix_alpha,
        mixup_prob=f.mixup_prob,
        switch_prob=f.switch_prob,
        threads=f.threads,
        device=f.device,
        bfloat16=f.bfloat16,
    )
    print(json.dumps(result))


def _define_flags() -> None:
    """Defined only when run as a program: the benchmark CLI imports this module."""
    flags.DEFINE_string("model", None, "timm model name.", required=True)
    flags.DEFINE_integer("batch", 8, "Images per step.")
    flags.DEFINE_integer("image_size", 224, "Square input size.")
    flags.DEFINE_integer("num_classes", 1000, "Classes of the head.")
    flags.DEFINE_integer("steps", 5, "Timed steps (after one warm-up step).")
    flags.DEFINE_float("drop_path", 0.1, "Stochastic depth rate.")
    flags.DEFINE_float("label_smoothing", 0.1, "Label smoothing.")
    flags.DEFINE_float("ema_decay", 0.0, "EMA decay (0 = no EMA).")
    flags.DEFINE_float("mixup_alpha", 0.0, "Mixup's Beta parameter (0 = off).")
    flags.DEFINE_float("cutmix_alpha", 0.0, "CutMix's Beta parameter (0 = off).")
    flags.DEFINE_float("mixup_prob", 1.0, "The probability of mixing a batch.")
    flags.DEFINE_float("switch_prob", 0.5, "The probability of CutMix over Mixup.")
    flags.DEFINE_integer("threads", 0, "torch threads (0 = every core this process may run on).")
    flags.DEFINE_string("device", "cpu", "torch device: cpu or cuda.")
    flags.DEFINE_bool("bfloat16", False, "Forward under bfloat16 autocast.")


if __name__ == "__main__":
    _define_flags()
    app.run(main)
