"""Mixup / CutMix on device with soft targets (timm `Mixup`, mode 'batch')."""

import jax
import jax.numpy as jnp


def one_hot_smoothed(labels, num_classes: int, smoothing: float):
    off = smoothing / num_classes
    return jax.nn.one_hot(labels, num_classes) * (1.0 - smoothing) + off


def mixup_cutmix(
    rng, images, labels, *, num_classes, mixup_alpha, cutmix_alpha, switch_prob, prob, smoothing
):
    """Mixes each image with the batch flipped (timm's pairing); returns images, soft targets.

    One lambda per (device-local) batch; CutMix is chosen with `switch_prob` when both
    alphas are positive, and the lambda is corrected to the pasted box area.
    """
    use_rng, switch_rng, mix_rng, cut_rng, box_rng = jax.random.split(rng, 5)
    apply = jax.random.uniform(use_rng) < prob
    use_cutmix = (cutmix_alpha > 0) & (
        (mixup_alpha <= 0) | (jax.random.uniform(switch_rng) < switch_prob)
    )
    lam_mix = jax.random.beta(mix_rng, max(mixup_alpha, 1e-8), max(mixup_alpha, 1e-8))
    lam_cut = jax.random.beta(cut_rng, max(cutmix_alpha, 1e-8), max(cutmix_alpha, 1e-8))

    height, width = images.shape[1:3]
    cut_ratio = jnp.sqrt(1.0 - lam_cut)
    cut_h, cut_w = (height * cut_ratio).astype(jnp.int32), (width * cut_ratio).astype(jnp.int32)
    cy, cx = jax.random.randint(box_rng, (2,), 0, jnp.array([height, width]))
    y0, y1 = jnp.clip(cy - cut_h // 2, 0, height), jnp.clip(cy + cut_h // 2, 0, height)
    x0, x1 = jnp.clip(cx - cut_w // 2, 0, width), jnp.clip(cx + cut_w // 2, 0, width)
    rows, cols = jnp.arange(height)[:, None], jnp.arange(width)[None, :]
    box = ((rows >= y0) & (rows < y1) & (cols >= x0) & (cols < x1))[None, :, :, None]
    lam_box = 1.0 - (y1 - y0) * (x1 - x0) / (height * width)

    flipped = images[::-1]
    lam = jnp.where(apply, jnp.where(use_cutmix, lam_box, lam_mix), 1.0)
    mixed = jnp.where(
        use_cutmix, jnp.where(box, flipped, images), lam_mix * images + (1.0 - lam_mix) * flipped
    )
    images = jnp.where(apply, mixed, images)
    targets = one_hot_smoothed(labels, num_classes, smoothing)
    return images, lam * targets + (1.0 - lam) * targets[::-1]
