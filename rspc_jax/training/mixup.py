"""Mixup / CutMix on device with soft targets (timm `Mixup`, mode 'batch')."""

import math

import jax
import jax.numpy as jnp

# Marsaglia-Tsang accepts at least 95% of its proposals for a shape >= 1, so all of these are
# rejected with probability below 1e-20; the draw is then d = shape - 1/3 (v = 1).
_GAMMA_PROPOSALS = 16


def one_hot_smoothed(labels, num_classes: int, smoothing: float):
    off = smoothing / num_classes
    return jax.nn.one_hot(labels, num_classes) * (1.0 - smoothing) + off


def _log_gamma(key, alpha: float):
    """log of one Gamma(alpha, 1) draw, without a loop: Marsaglia-Tsang with a fixed number
    of proposals drawn at once, the first accepted one kept (and for alpha < 1 the usual
    boost, Gamma(alpha+1) * U^(1/alpha), in log space so that tiny alphas stay finite).

    Written out because jax.random.gamma rejects in while loops, and a GPU copies a while
    loop's predicate to the host on every iteration: the train step stalled on these."""
    shape = alpha + 1.0 if alpha < 1.0 else alpha
    d = shape - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    normal_key, accept_key, boost_key = jax.random.split(key, 3)
    x = jax.random.normal(normal_key, (_GAMMA_PROPOSALS,))
    v = (1.0 + c * x) ** 3
    log_v = jnp.log(jnp.where(v > 0, v, 1.0))
    log_u = jnp.log(jax.random.uniform(accept_key, (_GAMMA_PROPOSALS,)))
    accepted = (v > 0) & (log_u < 0.5 * x**2 + d - d * v + d * log_v)
    log_gamma = math.log(d) + jnp.where(accepted.any(), log_v[jnp.argmax(accepted)], 0.0)
    if alpha < 1.0:  # U > 0: two log(0) boosts would make the beta draw -inf - -inf = NaN
        u = jax.random.uniform(boost_key, minval=jnp.finfo(jnp.float32).tiny)
        log_gamma += jnp.log(u) / alpha
    return log_gamma


def symmetric_beta(key, alpha: float):
    """One Beta(alpha, alpha) draw (timm's mixing lambda), as X / (X + Y) of two gammas."""
    x_key, y_key = jax.random.split(key)
    return jax.nn.sigmoid(_log_gamma(x_key, alpha) - _log_gamma(y_key, alpha))


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
    # An alpha of 0 switches its kind of mixing off: its lambda is then never used.
    lam_mix = symmetric_beta(mix_rng, mixup_alpha) if mixup_alpha > 0 else 1.0
    lam_cut = symmetric_beta(cut_rng, cutmix_alpha) if cutmix_alpha > 0 else 1.0

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
