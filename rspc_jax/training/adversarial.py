"""Adversarial-training baselines inside the jitted, sharded train step: FGSM with a
random start, k-step PGD and TRADES (Debenedetti's thesis 2.1.2 and 4.1; the RSPC
paper's Fig. 7 compares RSPC with TRADES).

Attacks work on pixels in [0, 1] with the normalisation inside the model function,
under an L-inf budget eps that can warm up linearly over the first epochs. As in the
thesis's code (vits-robustness-torch `attacks.py`): every attack starts at
x + U[-eps, eps] + 1e-5 projected back to the ball and to [0, 1], takes `steps` signed
gradient steps of `step_size` (FGSM = one step), and projects after each. Per-example
attack losses are summed, so an example's perturbation does not depend on the batch
(or on how it is split over devices).
"""

import dataclasses

import jax
import jax.numpy as jnp

from rspc_jax import rspc
from rspc_jax.evaluation.attacks import project_linf, signed_ascent
from rspc_jax.training import checks

METHODS = checks.CHOICES["adversarial.method"]
START_OFFSET = 1e-5  # the thesis code adds it to the uniform random start


@dataclasses.dataclass(frozen=True)
class Settings:
    """config.adversarial resolved for the step (see config_defaults)."""

    method: str  # 'fgsm' | 'pgd' | 'trades'
    eps: float  # final L-inf budget in [0, 1] pixel units
    steps: int  # attack steps (FGSM: 1; the thesis's 2-step FGSM: 2)
    step_size: float  # per step, pixel units
    beta: float  # TRADES weight of the KL term
    warmup_steps: int  # eps grows linearly over these steps (whole epochs); 0 = off
    steps_per_epoch: int
    attack_bn: str  # BatchNorm during the attack: 'train' (batch statistics) | 'eval'


def resolve(config, steps_per_epoch: int):
    """Settings from config.adversarial, or None when adversarial training is off."""
    a = config.adversarial
    if a.method == "none":
        return None
    if a.method not in METHODS:
        raise ValueError(f"config.adversarial.method={a.method!r} is not one of {METHODS}")
    steps = 1 if a.method == "fgsm" and not a.steps else a.steps
    if steps < 1:
        raise ValueError(f"config.adversarial.steps={a.steps} must be >= 1")
    # FGSM steps of eps / k reach the border in k steps (thesis: one step of eps); PGD and
    # TRADES default to 2.5 eps / k (Madry et al.'s rule, TRADES' 0.007 for 0.031 in 10).
    default_size = a.eps / steps if a.method == "fgsm" else 2.5 * a.eps / steps
    return Settings(
        method=a.method,
        eps=a.eps,
        steps=steps,
        step_size=a.step_size or default_size,
        beta=a.beta,
        warmup_steps=int(a.eps_warmup_epochs * steps_per_epoch),
        steps_per_epoch=steps_per_epoch,
        attack_bn=a.attack_bn,
    )


def epsilon_at(step, settings: Settings):
    """The budget at `step`: epoch e < warm-up epochs W gives eps * e / W (the thesis's
    linear schedule, constant within an epoch), then eps."""
    if settings.warmup_steps <= 0:
        return jnp.asarray(settings.eps, jnp.float32)
    epoch = step // settings.steps_per_epoch
    warmup_epochs = settings.warmup_steps // settings.steps_per_epoch
    return settings.eps * jnp.minimum(epoch / warmup_epochs, 1.0).astype(jnp.float32)


def random_start(rng, example_ids, pixels, eps):
    """x + U[-eps, eps] + 1e-5, projected; the noise is keyed by global example index."""
    uniform = rspc.uniform_noise(rng, example_ids, pixels.shape[1:])
    return project_linf(pixels + (2.0 * uniform - 1.0) * eps + START_OFFSET, pixels, eps)


def kl_divergence(clean_logits, adv_logits):
    """Per-example KL(softmax(clean) || softmax(adv)) (TRADES' robust term)."""
    p = jax.nn.softmax(clean_logits.astype(jnp.float32))
    return jnp.sum(
        p
        * (
            jax.nn.log_softmax(clean_logits.astype(jnp.float32))
            - jax.nn.log_softmax(adv_logits.astype(jnp.float32))
        ),
        axis=-1,
    )


def adversarial_loss(
    params,
    batch_stats,
    images,
    targets,
    start_rng,
    example_ids,
    step,
    *,
    model,
    settings: Settings,
    mean,
    std,
    rngs,
    compute_dtype=None,
):
    """The classifier's loss on adversarial examples of `images` (normalised):
    fgsm/pgd: CE(f(x_adv)); trades: CE(f(x)) + beta * mean KL(f(x) || f(x_adv)).
    Returns (loss, aux) like rspc.plain_loss (aux: ce, logits, batch_stats, eps)."""
    mean, std = jnp.asarray(mean, jnp.float32), jnp.asarray(std, jnp.float32)
    pixels = images * std + mean
    eps = epsilon_at(step, settings)
    frozen = jax.lax.stop_gradient(params)

    def forward(p, x, stats, **kwargs):
        train = kwargs.pop("train", True)
        mutable = ["batch_stats"] if train else False
        out = rspc.apply_model(
            model,
            p,
            stats,
            (x - mean) / std,
            compute_dtype=compute_dtype,
            train=train,
            mutable=mutable,
            rngs=rngs,
            **kwargs,
        )
        return out if train else (out, {"batch_stats": stats})

    def attack_logits(x):
        # The thesis attacks in train mode (batch statistics, dropout on); statistics
        # computed during the attack are discarded either way.
        return forward(frozen, x, batch_stats, train=settings.attack_bn == "train")[0]

    start = random_start(start_rng, example_ids, pixels, eps)
    if settings.method == "trades":
        clean_logits, state = forward(params, pixels, batch_stats)
        target = jax.lax.stop_gradient(clean_logits)

        def attack_loss(x):
            return kl_divergence(target, attack_logits(x)).sum()

        x_adv = signed_ascent(
            attack_loss, pixels, start, eps=eps, step_size=settings.step_size, steps=settings.steps
        )
        adv_logits, state = forward(params, x_adv, state.get("batch_stats", batch_stats))
        ce = rspc.cross_entropy(clean_logits, targets)
        robust = jnp.mean(kl_divergence(clean_logits, adv_logits))
        loss = ce + settings.beta * robust
        aux = dict(ce=ce, robust_kl=robust, logits=clean_logits)
    else:

        def attack_loss(x):
            return rspc.per_example_cross_entropy(attack_logits(x), targets).sum()

        x_adv = signed_ascent(
            attack_loss, pixels, start, eps=eps, step_size=settings.step_size, steps=settings.steps
        )
        adv_logits, state = forward(params, x_adv, batch_stats)
        loss = ce = rspc.cross_entropy(adv_logits, targets)
        aux = dict(ce=ce, logits=adv_logits)
    aux.update(batch_stats=state.get("batch_stats", {}), eps=eps)
    return loss, aux
