"""The small-scale reproduction study on the embedded digits (docs/results.md, 'Small-scale study'):

    python -m rspc_jax.study --config=configs/demo_study.py --workdir=runs/study

Trains, with the demo's budget (920 steps) and seeds 0, 1, 2: the plain baseline, RSPC
(official defaults), RSPC with randomly selected patches and clean + corrupted training
without alignment (paper Table 3 rows); evaluates each with the suites below and writes
results.md (mean ± std over seeds) and the figures. `:smoke` runs one seed of a few steps
of the 2-block model, plain and RSPC only (the test suite checks that it writes every file). One run of it alone:
`python -m rspc_jax.main --config=configs/demo_study.py --workdir=runs/demo` (the demo).
"""

import importlib.util
import os

import ml_collections


def get_config(arg=None):
    spec = importlib.util.spec_from_file_location(
        "demo_config", os.path.join(os.path.dirname(__file__), "demo.py")
    )
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    if arg not in (None, "", "plain", "smoke"):
        raise ValueError(
            f"unknown variant {arg!r} of configs/demo_study.py; use 'plain' or 'smoke'"
        )
    c = demo.get_config(arg)
    c.study = ml_collections.ConfigDict(
        dict(
            # 'rspc' or names of rspc_jax.training.ablations ('clean' is the plain baseline).
            methods=("clean", "rspc", "random_patches", "clean_and_corrupted"),
            seeds=(0, 1, 2),
        )
    )
    e = c.evaluation
    e.suites = "clean,patch_occlusion,attention_stability,corrupted_local,adversarial"
    e.occlusion_rho = 0.1  # 2 of the 16 patches (the official count rule)
    e.occlusion_masks = 100
    e.attacks = "pgd"  # PGD at a small eps on every test image
    e.pgd_eps, e.pgd_step, e.pgd_steps = 2 / 255, 0.5 / 255, 5
    e.adversarial_examples = 0
    if arg == "smoke":
        c.study.methods = ("clean", "rspc")
        c.study.seeds = (0,)
        c.total_steps = 4
        c.eval_every_steps = 4
        c.checkpoint_every_steps = 4
        e.occlusion_masks = 4
        e.figure_images = 2
        e.num_examples = 32
        e.corruptions = "gaussian_noise,fog"
        e.severities = (3,)
    return c
