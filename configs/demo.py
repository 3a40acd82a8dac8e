"""Embedded demo: a 4-block ViT trained with RSPC on scikit-learn's digits, on CPU.

    python -m rspc_jax.main --config=configs/demo.py --workdir=/tmp/rspc_demo

Needs no download: the 1,797 8x8 digit images ship with scikit-learn; they are
written as the tfds dataset `sklearn_digits` (1,500 train / 297 test) on first use
and upsampled to 32x32 RGB; the ViT sees 4x4 tokens of 8x8 pixels. Expected: >= 95%
test accuracy in about 4 minutes on 2 CPU cores (docs/results.md, 'The demo run', has the
measured figure). Variants:

    configs/demo.py:plain   the same run without RSPC (the baseline)
    configs/demo.py:smoke   a few steps of a 2-block model (used by the tests)
"""

from rspc_jax.training import defaults as config_defaults


def get_config(arg=None):
    c = config_defaults.get_default_config()
    c.model_name = "vit_demo"
    # Listed so that `--config.model.<field>=...` can override them.
    c.model = dict(patch_size=8, width=96, depth=4, num_heads=4, mlp_ratio=4.0, drop_path_rate=0.1)
    c.dataset = "sklearn_digits"
    c.image_size = 32
    c.augment = "digits"
    c.batch_size = 64
    c.eval_batch_size = 304  # 297 test images in one padded batch
    c.num_epochs = 40
    c.label_smoothing = 0.1
    c.optimizer.lr = 1.6e-2  # peak lr 2e-3 after the DeiT scaling (x 64/512)
    c.optimizer.warmup_epochs = 2
    c.log_every_steps = 50
    c.eval_every_steps = 115  # every 5 epochs
    c.checkpoint_every_steps = 230
    # Four steps per compiled call between log, eval and checkpoint steps: the same run
    # (equal evaluations at every eval step) in 13% less time on 2 CPU cores (docs/speed.md).
    c.steps_per_call = 4
    # Robustness report (`python -m rspc_jax.evaluate --config=configs/demo.py`): the
    # protocols' settings, with the attacks on the first 100 test digits so that the whole
    # report takes minutes on 2 CPU cores.
    c.evaluation.adversarial_examples = 100
    # Analyses (`python -m rspc_jax.analyze --config=configs/demo.py`): the grid attack's
    # +-16 px at 224 px is 7% of the image; +-4 px (1 px steps) is 12% of the 32 px digits.
    c.analysis.max_translation = 4.0

    if arg == "plain":
        c.rspc.enabled = False
    elif arg == "smoke":
        c.model.depth = 2
        c.model.width = 32
        c.model.num_heads = 2
        c.total_steps = 6
        c.log_every_steps = 2
        c.eval_every_steps = 6
        c.checkpoint_every_steps = 3
        c.steps_per_call = 1  # one compile per test run
    elif arg not in (None, ""):
        raise ValueError(f"unknown variant {arg!r} of configs/demo.py; use 'plain' or 'smoke'")
    return c
