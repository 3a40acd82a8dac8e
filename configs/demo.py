"""Embedded demo: a 4-block ViT trained with RSPC on scikit-learn's digits, on CPU.

    python -m rspc_jax.main --config=configs/demo.py --workdir=/tmp/rspc_demo

Needs no download: the 1,797 8x8 digit images ship with scikit-learn; they are
written as the tfds dataset `sklearn_digits` (1,500 train / 297 test) on first use
and upsampled to 32x32 RGB; the ViT sees 4x4 tokens of 8x8 pixels. Expected: >= 95%
test accuracy in about 4 minutes on 2 CPU cores (docs/results.md, 'The demo run', has the
measured figure). The settings are `rspc_jax.training.recipes.apply_digits_demo`, shared with
configs/demo_study.py. Variants:

    configs/demo.py:plain   the same run without RSPC (the baseline)
    configs/demo.py:smoke   a few steps of a 2-block model (used by the tests)
    configs/demo.py:<name>  an ablation of rspc_jax/training/ablations.py
"""

from rspc_jax.training import defaults, recipes


def get_config(arg=None):
    c = defaults.get_default_config()
    recipes.apply_digits_demo(c)
    return recipes.select_variant(c, arg, smoke=recipes.apply_digits_demo_smoke)
