"""imagenet_c: accuracy on the 15 (+4) corruptions at 5 severities and the mCE against
AlexNet's errors, from the released JPEGs or tfds imagenet2012_corrupted."""

from rspc_jax.data import eval as eval_data
from rspc_jax.evaluation import figures as plots
from rspc_jax.evaluation import loop as runner
from rspc_jax.evaluation import protocols, report, sources
from rspc_jax.evaluation.loop import Context
from rspc_jax.evaluation.suites import shift_data


def run(ctx: Context) -> dict:
    shift_data.require_classes(ctx, "imagenet_c", 1000)
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
                source = shift_data.files_source(ctx, paths, labels, eval_data.crop_only)
            else:
                source = shift_data.tfds_source(
                    ctx,
                    f"imagenet2012_corrupted/{name}_{severity}",
                    "validation",
                    eval_data.crop_only,
                    how,
                )
            accuracy[(name, severity)] = shift_data.source_accuracy(
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
        preprocessing=shift_data.CROP_ONLY,
        accuracy={f"{c}/{s}": v for (c, s), v in accuracy.items()},
        corruptions=list(names),
        severities=list(severities),
        **summary,
    )


def rows(result: dict) -> list[tuple[str, str]]:
    pct, num = report.pct, report.num
    per_corruption = [
        (f"{c}: accuracy (%) / CE", f"{pct(v['accuracy'])} / {num(v.get('ce'))}")
        for c, v in result["per_corruption"].items()
    ]
    return per_corruption + [
        ("mCE (15)", num(result["mce"])),
        ("mCE w/o noise (12)", num(result["mce_no_noise"])),
        ("mean accuracy (15) (%)", pct(result["mean_accuracy"])),
        ("mean accuracy w/o noise (%)", pct(result["mean_accuracy_no_noise"])),
        ("mean accuracy (19) (%)", pct(result["mean_accuracy_19"])),
    ]


def figures(result: dict, arrays: dict, out_dir: str) -> list[str]:
    return [plots.corruption_errors(result, out_dir, "imagenet_c")]
