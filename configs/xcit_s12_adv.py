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
picks the state kept in <workdir>/best. The attack sees the model in train mode (the
thesis's XLA constraint; `attack_bn`). Choices the thesis leaves open: drop path 0.05 (the
XCiT paper's S12 value; 0.1 for M12/L12), no label smoothing, no EMA. Reference (not
measured by us): thesis XCiT-S12 72.34% clean / 41.78% AutoAttack at 4/255 (RobustBench
5k subset). `:smoke` is a 2-block XCiT on the digits.
"""

from rspc_jax.training import defaults as config_defaults

_MODELS = {
    "": ("xcit_small_12_p16_224", 0.05),
    "m12": ("xcit_medium_12_p16_224", 0.1),
    "l12": ("xcit_large_12_p16_224", 0.1),
}


def apply_adversarial_recipe(c, eps: float = 4 / 255) -> None:
    """The thesis's adversarial-training switches (shared with the CIFAR fine-tuning)."""
    c.rspc.enabled = False
    c.adversarial.method = "fgsm"
    c.adversarial.eps = eps
    c.adversarial.eps_warmup_epochs = 10
    c.adversarial.attack_bn = "train"
    c.eval_fgsm_eps = eps
    c.keep_best = "fgsm_accuracy"


def get_config(arg=None):
    c = config_defaults.get_default_config()
    arg = arg or ""
    smoke = arg == "smoke"
    if not smoke and arg not in _MODELS:
        raise ValueError(
            f"unknown variant {arg!r} of configs/xcit_s12_adv.py; use '', 'm12', 'l12' or 'smoke'"
        )
    c.model_name, drop_path = _MODELS["" if smoke else arg]
    c.model = dict(drop_path_rate=drop_path)
    c.dataset = "imagenet2012"
    c.image_size = 224
    c.augment = "imagenet"
    c.color_jitter = 0.4
    c.batch_size = 512
    c.eval_batch_size = 1024
    c.num_epochs = 110
    c.optimizer.update(
        dict(
            lr=5e-4,
            lr_base_batch=512,
            warmup_epochs=5,
            warmup_lr=5e-6,
            min_lr=5e-5,
            cooldown_epochs=10,
            weight_decay=0.5,
        )
    )
    c.log_every_steps = 100
    c.checkpoint_every_steps = 2500
    apply_adversarial_recipe(c)
    if smoke:
        config_defaults.apply_smoke(
            c,
            "xcit_small_12_p16_224",
            dict(embed_dim=16, depth=2, num_heads=2, cls_attn_layers=1, drop_path_rate=0.0),
        )
        c.eval_every_steps = 3
    return c
