"""Adversarial fine-tuning of an adversarially pre-trained XCiT-S12 on CIFAR-10 at 32 px
(Debenedetti's thesis, 4.2 "CIFAR-10").

    python -m rspc_jax.main --config=configs/cifar10_xcit_s12_adv.py --workdir=runs/c10_adv \
      --config.init_from=gs://BUCKET/adv/xcit_s12/best/export.safetensors

The patch-size adaptation: the 16x16 convolutional stem keeps its weights but its first
two convolutions take stride 1 (patch_size 4), so 32 px images give 8x8 tokens; XCiT's
Fourier position encoding needs no resizing and the new 10-class head starts fresh.
TRADES with PGD-10 at eps 8/255 (beta 6, TRADES' default), 20 epochs, lr 2e-4, no colour
jitter, random resized crops with aspect ratios in [0.95, 1.05] and areas in [0.8, 1.0]:
the thesis gives [0.8, 1.2], and crops larger than the image are not possible with
tf.image's sampler, so the range stops at 1.0. Otherwise the ImageNet recipe of
configs/xcit_s12_adv.py, `rspc_jax.training.recipes.apply_thesis_imagenet_recipe` (batch 512, weight decay 0.5, early stopping on FGSM accuracy);
no eps warm-up when fine-tuning. Reference (not measured by us): thesis 90.06% clean /
56.14% AutoAttack at 8/255.
"""

from rspc_jax.training import defaults, recipes


def get_config(arg=None):
    c = defaults.get_default_config()
    recipes.apply_thesis_imagenet_recipe(c)
    c.model_name = "xcit_small_12_p16_224"
    c.model = dict(patch_size=4, drop_path_rate=0.05)
    c.dataset = "cifar10"
    c.image_size = 32
    c.color_jitter = 0.0
    c.crop_area = (0.8, 1.0)
    c.crop_aspect = (0.95, 1.05)
    c.num_epochs = 20
    c.optimizer.update(dict(lr=2e-4, lr_base_batch=512, warmup_epochs=1, cooldown_epochs=0))
    c.eval_batch_size = 1000
    recipes.apply_adversarial_recipe(c, eps=8 / 255)
    c.adversarial.update(dict(method="trades", steps=10, beta=6.0, eps_warmup_epochs=0))
    c.init_head = "reset"
    c.checkpoint_every_steps = 500
    return recipes.select_variant(c, arg, smoke=_smoke)


def _smoke(c):
    """A 2-block XCiT with the stride-1 stem on the digits: PGD-2, evals every 3 steps."""
    recipes.apply_smoke(
        c,
        "xcit_small_12_p16_224",
        dict(embed_dim=16, depth=2, num_heads=2, cls_attn_layers=1, patch_size=4),
    )
    c.adversarial.steps = 2
    c.eval_every_steps = 3
