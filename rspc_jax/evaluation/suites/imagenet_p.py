"""imagenet_p: flip probability and top-5 distance over ImageNet-P's released .mp4
sequences, and mFR / mT5D against AlexNet's when its numbers are given."""

import json

import jax
import numpy as np

from rspc_jax.data import eval as eval_data
from rspc_jax.evaluation import loop as runner
from rspc_jax.evaluation import protocols, report, sources
from rspc_jax.evaluation.loop import Context, SuiteSkipped, run_pass
from rspc_jax.evaluation.suites import shift_data


def _video_source(ctx: Context, paths, labels, frames: int) -> runner.Source:
    """This host's videos as (uint8 (T, size, size, 3), label), centre-cropped."""
    size = ctx.config.image_size
    rows, largest = eval_data.host_share(len(paths))

    def videos():
        for i in range(rows.start, rows.stop):
            video = sources.read_video(paths[i])
            if video.shape[0] != frames:
                raise ValueError(
                    f"{paths[i]} has {video.shape[0]} frames, the other videos of its "
                    f"perturbation {frames}: re-extract the ImageNet-P archive"
                )
            top = (video.shape[1] - size) // 2
            left = (video.shape[2] - size) // 2
            yield video[:, top : top + size, left : left + size], labels[i]

    return videos(), largest


def _video_step(ctx: Context):
    def step(variables, batch, rng):
        videos = batch["image"]
        logits = ctx.logits(variables, videos.reshape((-1,) + videos.shape[2:]))
        return dict(logits=logits.reshape(videos.shape[:2] + logits.shape[-1:]).astype(np.float32))

    return runner.sharded(ctx, step)


def run(ctx: Context) -> dict:
    shift_data.require_classes(ctx, "imagenet_p", 1000)
    root = ctx.settings.imagenet_p_dir
    if not root:
        raise SuiteSkipped(
            "set --config.evaluation.imagenet_p_dir=<root> with "
            "<root>/<perturbation>/<wnid>/*.mp4 (Zenodo record 3565846)"
        )
    perturbations = (
        tuple(p for p in ctx.settings.imagenet_p_perturbations.split(",") if p)
        or protocols.IMAGENET_P_PERTURBATIONS
    )
    size = ctx.config.image_size
    step = _video_step(ctx)
    flip, t5d, videos = {}, {}, {}
    for perturbation in perturbations:
        paths, labels = sources.imagenet_p_examples(root, perturbation)
        first = sources.read_video(paths[0])
        if min(first.shape[1:3]) < size:
            raise SuiteSkipped(
                f"ImageNet-P frames are {first.shape[1]} px, smaller than the model's {size} px"
            )
        frames, noise = first.shape[0], "noise" in perturbation
        devices = jax.local_device_count()
        per_host = max(devices, ctx.local_batch // frames // devices * devices)

        def metrics(out, noise=noise):
            return dict(
                fr=protocols.per_video_flip_rates(out["logits"].argmax(-1), noise=noise),
                t5d=protocols.per_video_top5_distances(out["logits"], noise=noise),
            )

        out = run_pass(
            ctx,
            step,
            jax.random.PRNGKey(0),
            label=f"imagenet_p {perturbation}",
            source=_video_source(ctx, paths, labels, frames),
            image_shape=(frames, size, size, 3),
            local_batch=per_host,
            host_fn=metrics,
        )
        flip[perturbation] = float(out["fr"].mean())
        t5d[perturbation] = float(out["t5d"].mean())
        videos[perturbation] = int(out["fr"].size)
    result = dict(
        data=f"released .mp4 sequences in {root}",
        difficulty=1,
        preprocessing="each frame CenterCrop(image_size), then the training normalisation",
        flip_probability=flip,
        top5_distance=t5d,
        videos=videos,
        mean_flip_probability=float(np.mean(list(flip.values()))),
        mean_top5_distance=float(np.mean(list(t5d.values()))),
    )
    if ctx.settings.imagenet_p_alexnet:
        with open(ctx.settings.imagenet_p_alexnet) as f:
            alexnet = json.load(f)
        result["mFR"] = protocols.normalized_rate(flip, alexnet["flip_probability"])
        result["mT5D"] = protocols.normalized_rate(t5d, alexnet["top5_distance"])
    else:
        result["note"] = (
            "mFR/mT5D need AlexNet's flip probabilities and top-5 distances, which "
            "are not published in machine-readable form; pass them as JSON with "
            "--config.evaluation.imagenet_p_alexnet"
        )
    return result


def rows(result: dict) -> list[tuple[str, str]]:
    pct, num = report.pct, report.num
    lines = [
        (f"{p}: FP (%) / T5D", f"{pct(fp)} / {result['top5_distance'][p]:.3f}")
        for p, fp in result["flip_probability"].items()
    ]
    lines.append(
        (
            "mean FP (%) / mean T5D",
            f"{pct(result['mean_flip_probability'])} / {result['mean_top5_distance']:.3f}",
        )
    )
    if "mFR" in result:
        lines.append(
            ("mFR / mT5D", f"{num(result['mFR']['mean'])} / {num(result['mT5D']['mean'])}")
        )
    return lines
