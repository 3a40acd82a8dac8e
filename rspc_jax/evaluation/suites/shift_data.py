"""What the suites on released benchmark data share: where their examples come from (the
released folders when `config.evaluation.<suite>_dir` is set, else the tfds builder where one
exists, else the suite is skipped with how to provide the data; protocols:
docs/evaluation.md, metrics: `protocols`, file layouts: `sources`), the 200-class ImageNet
subsets (A, R) and the CIFAR-C suites, and their report rows."""

import jax
import numpy as np

from rspc_jax.data import eval as eval_data
from rspc_jax.data import specs as datasets
from rspc_jax.evaluation import loop as runner
from rspc_jax.evaluation import protocols, report, sources
from rspc_jax.evaluation.loop import Context, SuiteSkipped, run_pass

CROP_ONLY = (
    "CenterCrop(image_size) of the released 224-px images (the identity at 224; RVT, "
    "RSPC and Hendrycks' protocol), then the training normalisation"
)
# tfds cifar10_corrupted spells two corruptions differently from the .npy files.
_TFDS_CIFAR_NAMES = {"glass_blur": "frosted_glass_blur", "elastic_transform": "elastic"}


def require_classes(ctx: Context, suite: str, classes: int) -> None:
    if ctx.spec.num_classes != classes:
        raise SuiteSkipped(
            f"{suite} needs a {classes}-class model; this run's dataset "
            f"{ctx.config.dataset} has {ctx.spec.num_classes} classes"
        )


def tfds_source(ctx: Context, builder: str, split: str, preprocess, how: str) -> runner.Source:
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


def files_source(ctx: Context, paths, labels, preprocess) -> runner.Source:
    ds, largest = eval_data.file_examples(
        paths, labels, image_size=ctx.config.image_size, preprocess=preprocess
    )
    return runner.as_source(ds, largest)


def arrays_source(ctx: Context, images, labels, preprocess) -> runner.Source:
    ds, largest = eval_data.array_examples(
        images, labels, image_size=ctx.config.image_size, preprocess=preprocess
    )
    return runner.as_source(ds, largest)


def source_accuracy(ctx: Context, step, source: runner.Source, label: str) -> float:
    return float(
        run_pass(ctx, step, jax.random.PRNGKey(0), label=label, source=source)["correct"].mean()
    )


def run_preprocess(ctx: Context):
    return eval_data.eval_preprocess_fn(ctx.config.dataset, ctx.config.eval_preprocess)


def run_preprocess_name(ctx: Context) -> str:
    return (
        f"the run's eval preprocessing ({ctx.config.eval_preprocess or ctx.config.dataset + ' default'}) "
        f"at {ctx.config.image_size} px, then the training normalisation"
    )


def imagenet_subset(
    ctx: Context, suite: str, wnids, indices, tfds_name: str, dir_key: str, origin: str
) -> dict:
    require_classes(ctx, suite, 1000)
    root = ctx.settings[dir_key]
    preprocess = run_preprocess(ctx)
    if root:
        paths, labels = sources.subset_folder_examples(root, wnids, indices)
        source = files_source(ctx, paths, labels, preprocess)
    else:
        source = tfds_source(
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
        preprocessing=run_preprocess_name(ctx),
        metric="top-1 with the logits restricted to the 200 classes",
        top1=float(out["correct"].mean()),
        num_examples=int(out["correct"].size),
    )


def cifar_c(ctx: Context, suite: str, classes: int, dir_key: str, tfds_name) -> dict:
    require_classes(ctx, suite, classes)
    root = ctx.settings[dir_key]
    how = (
        f"set --config.evaluation.{dir_key}=<root> with <root>/<corruption>.npy and "
        f"<root>/labels.npy ({sources.CIFAR_C_ORIGIN})"
    )
    if not root and not tfds_name:
        raise SuiteSkipped(how + " (tfds has no CIFAR-100-C)")
    preprocess = run_preprocess(ctx)
    step = runner.accuracy_step(ctx)
    names = protocols.corruption_names(ctx.settings.corruptions)
    severities = tuple(ctx.settings.severities)
    accuracy = {}
    for name in names:
        arrays = sources.cifar_c_arrays(root, name) if root else None
        for severity in severities:
            if root:
                images, labels = sources.cifar_c_severity(*arrays, severity)
                source = arrays_source(ctx, images, labels, preprocess)
            else:
                config = f"{_TFDS_CIFAR_NAMES.get(name, name)}_{severity}"
                source = tfds_source(ctx, f"{tfds_name}/{config}", "test", preprocess, how)
            accuracy[(name, severity)] = source_accuracy(
                ctx, step, source, f"{suite} {name} s{severity}"
            )
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
        preprocessing=run_preprocess_name(ctx),
        accuracy={f"{c}/{s}": v for (c, s), v in accuracy.items()},
        corruptions=list(names),
        severities=list(severities),
        **summary,
    )


def subset_rows(result: dict) -> list[tuple[str, str]]:
    return [
        ("top-1, 200 classes (%)", report.pct(result["top1"])),
        ("examples", str(result["num_examples"])),
    ]


def cifar_c_rows(result: dict) -> list[tuple[str, str]]:
    if "per_corruption" not in result:
        return [("accuracy (%) per corruption/severity", str(result["accuracy"]))]
    rows = [(f"{c} (%)", report.pct(a)) for c, a in result["per_corruption"].items()]
    return rows + [
        ("mean accuracy (15) (%)", report.pct(result["mean_accuracy"])),
        ("mean accuracy (19) (%)", report.pct(result["mean_accuracy_19"])),
    ]
