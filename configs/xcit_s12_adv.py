"""Adversarially trained XCiT-S12 on ImageNet-1k: the recipe of Debenedetti's thesis
("Adversarially Robust Vision Transformers", EPFL 2022, 4.1-4.2), as switches of
the same train loop.

    python -m rspc_jax.main --config=configs/xcit_s12_adv.py --workdir=gs://BUCKET/adv/xcit_s12
    python -m rspc_jax.main --config=configs/xcit_s12_adv.py:m12 ...   # XCiT-M12 (:l12 = L12)

FGSM adversarial training (random start U[-eps, eps] + 1e-5), eps 4/255 in [0, 1] pixels
warmed up linearly over 10 epochs; batch 512 (64 per core on a v3-8), lr 5e-4 x batch/512,
110 epochs: 5 warm-up epochs from 5e-6, cosine to 5e-5, 10 cool-down epochs; weight decay
0.5; basic augmentation only (random resized crop, flip, colour jitter 0.4), no RandAugment,
mixup, random erasing or repeated augmentation; early stopping: the eval's FGSM accuracy
picks the state kept in <workdir>/best (`rspc_jax.training.recipes.apply_thesis_imagenet_recipe`,
shared with configs/cifar10_xcit_s12_adv.py). The attack sees the model in train mode (the
thesis's XLA constraint; `attack_bn`). Choices the thesis leaves open: drop path 0.05 (the
XCiT paper's S12 value; 0.1 for M12/L12), no label smoothing, no EMA. Reference (not
measured by us): thesis XCiT-S12 72.34% clean / 41.78% AutoAttack at 4/255 (RobustBench
5k subset). `:smoke` is a 2-block XCiT on the digits.
"""

import functools

from rspc_jax.training import defaults, recipes


def get_config(arg=None):
    c = defaults.get_default_config()
    _set_model(c, "xcit_small_12_p16_224", drop_path=0.05)
    recipes.apply_thesis_imagenet_recipe(c)
    return recipes.select_variant(
        c,
        arg,
        m12=functools.partial(_set_model, name="xcit_medium_12_p16_224", drop_path=0.1),
        l12=functools.partial(_set_model, name="xcit_large_12_p16_224", drop_path=0.1),
        smoke=_smoke,
    )


def _set_model(c, name: str, drop_path: float) -> None:
    c.model_name = name
    c.model = dict(drop_path_rate=drop_path)


def _smoke(c):
    """A 2-block XCiT on the digits, evaluated every 3 steps."""
    recipes.apply_smoke(
        c,
        "xcit_small_12_p16_224",
        dict(embed_dim=16, depth=2, num_heads=2, cls_attn_layers=1, drop_path_rate=0.0),
    )
    c.eval_every_steps = 3
