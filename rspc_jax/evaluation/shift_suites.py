"""The suites on released benchmark data: imagenet_c, imagenet_a, imagenet_r, imagenet_p,
cifar10_c, cifar100_c (protocols: docs/evaluation.md; metrics: `protocols`; file
layouts: `sources`). Each reads the released folders when `config.evaluation.<suite>_dir`
is set, else the tfds builder where one exists, and is skipped with a message that says
how to provide the data when neither is there.
"""

import json

import jax
import numpy as np

from rspc_jax.data import eval as eval_data
from rspc_jax.data import specs as datasets
from rspc_jax.evaluation import loop as runner
from rspc_jax.evaluation import protocols, sources
from rspc_jax.evaluation.loop import Context, SuiteSkipped, run_pass

CROP_ONLY = (
    "CenterCrop(image_size) of the released 224-px images (the identity at 224; RVT, "
    "RSPC and Hendrycks' protocol), then the training normalisation"
)
# tfds cifar10_corrupted spells two corruptions differently from the .npy files.
_TFDS_CIFAR_NAMES = {"glass_blur": "frosted_glass_blur", "elastic_transform": "elastic"}


def _require_classes(ctx: Context, suite: str, classes: int) -> None:
    if ctx.spec.num_classes != classes:
        raise SuiteSkipped(
            f"{suite} needs a {classes}-class model; this run's dataset "
            f"{ctx.config.dataset} has {ctx.spec.num_classes} classes"
        )


def _tfds_source(ctx: Context, builder: str, split: str, preprocess, how: str) -> runner.Source:
    try:
        ds, largest = eval_data.eval_examples(
            dataset=ctx.config.dataset,
            data_dir=ctx.config.data_dir,
            split=split,
            image_size=ctx.config.image_size,
            builder_name=builder,
            preprocess=preprocess,
        )
    except datasets.DatasetNotFoundError as e:
        raise SuiteSkipped(f"{how}, or prepare the tfds dataset: {e}") from None
    return runner.as_source(ds, largest)


def _files_source(ctx: Context, paths, labels, preprocess) -> runner.Source:
    ds, largest = eval_data.file_examples(
        paths, labels, image_size=ctx.config.image_size, preprocess=preprocess
    )
    return runner.as_source(ds, largest)


def _arrays_source(ctx: Context, images, labels, preprocess) -> runner.Source:
    ds, largest = eval_data.array_examples(
        images, labels, image_size=ctx.config.image_size, preprocess=preprocess
    )
    return runner.as_source(ds, largest)


def _accuracy(ctx: Context, step, source: runner.Source, label: str) -> float:
    return float(
        run_pass(ctx, step, jax.random.PRNGKey(0), label=label, source=source)["correct"].mean()
    )


def _run_preprocess(ctx: Context):
    return eval_data.eval_preprocess_fn(ctx.config.dataset, ctx.config.eval_preprocess)


def _run_preprocess_name(ctx: Context) -> str:
    return (
        f"the run's eval preprocessing ({ctx.config.eval_preprocess or ctx.config.dataset + ' default'}) "
        f"at {ctx.config.image_size} px, then the training normalisation"
    )


# --------------------------------------------------------------------------------------
# ImageNet-C


def imagenet_c(ctx: Context) -> dict:
    _require_classes(ctx, "imagenet_c", 1000)
    root = ctx.settings.imagenet_c_dir
    how = (
        "set --config.evaluation.imagenet_c_dir=<root> with <root>/<corruption>/<severity>/"
        "<wnid>/*.JPEG (Zenodo record 2235448)"
    )
    step = runner.accuracy_step(ctx)
    names = protocols.corruption_names(ctx.settings.corruptions)
    severities = tuple(ctx.settings.severities)
    accuracy = {}
    for name in names:
        for severity in severities:
            if root:
                paths, labels = sources.imagenet_c_examples(root, name, severity)
                source = _files_source(ctx, paths, labels, eval_data.crop_only)
            else:
                source = _tfds_source(
                    ctx,
                    f"imagenet2012_corrupted/{name}_{severity}",
                    "validation",
                    eval_data.crop_only,
                    how,
                )
            accuracy[(name, severity)] = _accuracy(
                ctx, step, source, f"imagenet_c {name} s{severity}"
            )
    summary = protocols.imagenet_c_summary(accuracy)
    return dict(
        data=(
            f"released JPEGs in {root}"
            if root
            else "tfds imagenet2012_corrupted (re-generated corruptions, NOT bit-identical to the "
            "released files: do not compare its mCE with published numbers)"
        ),
        preprocessing=CROP_ONLY,
        accuracy={f"{c}/{s}": v for (c, s), v in accuracy.items()},
        corruptions=list(names),
        severities=list(severities),
        **summary,
    )


# --------------------------------------------------------------------------------------
# ImageNet-A / ImageNet-R: 200-class subsets, logits restricted to them


def _subset(
    ctx: Context, suite: str, wnids, indices, tfds_name: str, dir_key: str, origin: str
) -> dict:
    _require_classes(ctx, suite, 1000)
    root = ctx.settings[dir_key]
    preprocess = _run_preprocess(ctx)
    if root:
        paths, labels = sources.subset_folder_examples(root, wnids, indices)
        source = _files_source(ctx, paths, labels, preprocess)
    else:
        source = _tfds_source(
            ctx,
            tfds_name,
            "test",
            preprocess,
            f"set --config.evaluation.{dir_key}=<root> with <root>/<wnid>/* ({origin})",
        )
    out = run_pass(
        ctx, runner.accuracy_step(ctx, indices), jax.random.PRNGKey(0), label=suite, source=source
    )
    return dict(
        data=f"folders in {root}" if root else f"tfds {tfds_name}",
        preprocessing=_run_preprocess_name(ctx),
        metric="top-1 with the logits restricted to the 200 classes",
        top1=float(out["correct"].mean()),
        num_examples=int(out["correct"].size),
    )


def imagenet_a(ctx: Context) -> dict:
    return _subset(
        ctx,
        "imagenet_a",
        protocols.IMAGENET_A_WNIDS,
        protocols.IMAGENET_A_INDICES,
        "imagenet_a",
        "imagenet_a_dir",
        "hendrycks/natural-adv-examples",
    )


def imagenet_r(ctx: Context) -> dict:
    return _subset(
        ctx,
        "imagenet_r",
        protocols.IMAGENET_R_WNIDS,
        protocols.IMAGENET_R_INDICES,
        "imagenet_r",
        "imagenet_r_dir",
        "hendrycks/imagenet-r",
    )


# --------------------------------------------------------------------------------------
# ImageNet-P: flip probability and top-5 distance over the released .mp4 sequences


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


def imagenet_p(ctx: Context) -> dict:
    _require_classes(ctx, "imagenet_p", 1000)
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


# --------------------------------------------------------------------------------------
# CIFAR-10-C / CIFAR-100-C


def _cifar_c(ctx: Context, suite: str, classes: int, dir_key: str, tfds_name) -> dict:
    _require_classes(ctx, suite, classes)
    root = ctx.settings[dir_key]
    how = (
        f"set --config.evaluation.{dir_key}=<root> with <root>/<corruption>.npy and "
        f"<root>/labels.npy ({sources.CIFAR_C_ORIGIN})"
    )
    if not root and not tfds_name:
        raise SuiteSkipped(how + " (tfds has no CIFAR-100-C)")
    preprocess = _run_preprocess(ctx)
    step = runner.accuracy_step(ctx)
    names = protocols.corruption_names(ctx.settings.corruptions)
    severities = tuple(ctx.settings.severities)
    accuracy = {}
    for name in names:
        arrays = sources.cifar_c_arrays(root, name) if root else None
        for severity in severities:
            if root:
                images, labels = sources.cifar_c_severity(*arrays, severity)
                source = _arrays_source(ctx, images, labels, preprocess)
            else:
                config = f"{_TFDS_CIFAR_NAMES.get(name, name)}_{severity}"
                source = _tfds_source(ctx, f"{tfds_name}/{config}", "test", preprocess, how)
            accuracy[(name, severity)] = _accuracy(ctx, step, source, f"{suite} {name} s{severity}")
    # Severity blocks have equal size, so the mean over severities is the pooled accuracy.
    complete = set(severities) == set(protocols.SEVERITIES)
    summary = (
        protocols.cifar_c_summary(
            {n: float(np.mean([accuracy[(n, s)] for s in severities])) for n in names}
        )
        if complete
        else dict(note="aggregates need all 5 severities")
    )
    return dict(
        data=f"released .npy files in {root}" if root else f"tfds {tfds_name}",
        preprocessing=_run_preprocess_name(ctx),
        accuracy={f"{c}/{s}": v for (c, s), v in accuracy.items()},
        corruptions=list(names),
        severities=list(severities),
        **summary,
    )


def cifar10_c(ctx: Context) -> dict:
    return _cifar_c(ctx, "cifar10_c", 10, "cifar10_c_dir", "cifar10_corrupted")


def cifar100_c(ctx: Context) -> dict:
    return _cifar_c(ctx, "cifar100_c", 100, "cifar100_c_dir", None)


SUITES = {
    "imagenet_c": imagenet_c,
    "imagenet_a": imagenet_a,
    "imagenet_r": imagenet_r,
    "imagenet_p": imagenet_p,
    "cifar10_c": cifar10_c,
    "cifar100_c": cifar100_c,
}
