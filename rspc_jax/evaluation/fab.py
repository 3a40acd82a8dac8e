"""Targeted L-inf FAB (Croce & Hein, "Minimally distorted adversarial examples with a fast
adaptive boundary attack", ICML 2020) as AutoAttack's FAB-T runs it (docs/evaluation.md,
"Attacks: FAB-T").

FAB is a minimum-norm attack: it walks along projections onto the linearised decision
boundary between the label and a target class, biased towards the clean image, and keeps
the smallest adversarial example it meets. Pixels in [0, 1]; examples are independent, so
a batch may be sharded like the other attacks.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from rspc_jax.evaluation.attacks import (
    LogitsFn,
    at_least_float32,
    label_logit,
    misclassified,
    per_example,
    select_per_example,
)

NORM_FLOOR = 1e-8  # lower bound on the step norms in FAB's bias weight (the reference's)


def linf_step_to_hyperplane(points: jax.Array, w: jax.Array, shift: jax.Array) -> jax.Array:
    """Per row of the (B, d) `points`: the step delta of smallest L-inf norm with
    w . delta = shift that keeps points + delta in the box [0, 1]^d (FAB's projection onto a
    hyperplane intersected with the box).

    With budget lam, coordinate i can move |w_i| * min(lam, room_i) towards the hyperplane,
    room_i being its distance to the box face it moves to; that progress is piecewise linear
    in lam with breakpoints at the sorted rooms, so the smallest sufficient lam lies between
    the last breakpoint that falls short and the first that suffices. Where the box cannot
    reach the hyperplane the step goes to the box's corner nearest to it."""
    direction = jnp.sign(shift)[:, None] * jnp.sign(w)
    weight, need = jnp.abs(w), jnp.abs(shift)
    room = jnp.where(direction > 0, 1.0 - points, points)
    order = jnp.argsort(room, axis=1)
    room_sorted = jnp.take_along_axis(room, order, axis=1)
    weight_sorted = jnp.take_along_axis(weight, order, axis=1)
    total_weight = weight_sorted.sum(axis=1, keepdims=True)
    saturated = jnp.cumsum(weight_sorted * room_sorted, axis=1)  # coordinates <= k at their face
    unsaturated = total_weight - jnp.cumsum(weight_sorted, axis=1)  # weight of those > k
    progress = saturated + room_sorted * unsaturated  # at lam = room_sorted[:, k]
    first_enough = jnp.sum(progress < need[:, None], axis=1)
    before = jnp.maximum(first_enough - 1, 0)[:, None]
    has_before = first_enough > 0
    saturated_before = jnp.where(has_before, jnp.take_along_axis(saturated, before, 1)[:, 0], 0.0)
    slope = jnp.where(
        has_before, jnp.take_along_axis(unsaturated, before, 1)[:, 0], total_weight[:, 0]
    )
    lam = (need - saturated_before) / jnp.where(slope > 0, slope, 1.0)
    lam = jnp.where(first_enough == points.shape[1], room_sorted[:, -1], lam)
    return direction * jnp.minimum(lam[:, None], room)


class _FabState(NamedTuple):
    x_adv: jax.Array  # current iterate
    best_adv: jax.Array  # smallest adversarial example so far (x where none)
    best_norm: jax.Array  # (B,) its L-inf distance to x, inf where none


def fab_targeted(
    logits_fn: LogitsFn,
    x: jax.Array,
    y: jax.Array,
    y_target: jax.Array,
    *,
    n_iter: int = 100,
    alpha_max: float = 0.1,
    eta: float = 1.05,
    beta: float = 0.9,
) -> tuple[jax.Array, jax.Array]:
    """One run of targeted L-inf FAB from the clean point (AutoAttack's FAB-T restart 1,
    which has no random start, so no key is needed).

    Each iteration linearises g = z_target - z_y at the iterate x_k, projects both x_k and
    the clean x onto {g = 0} within the box (steps d1, d2), and moves to
    clip((1 - alpha)(x_k + eta d1) + alpha (x + eta d2)) with alpha = min(|d1| / (|d1| + |d2|),
    alpha_max) (norms L-inf), the weight that pulls the walk towards x. An iterate that is
    misclassified (any class but y) is kept if it is the closest so far and then pulled back
    to x + beta (x_k - x).

    Returns (best_adv, best_norm): the smallest misclassified point found and its L-inf
    distance to x, or (x, inf) where none was found; the attack fails at eps where
    best_norm > eps.
    """
    batch = x.shape[0]

    def flat(v):
        return v.reshape(batch, -1)

    def boundary(x_adv):
        """g = z_target - z_y at x_adv and its per-example gradient."""

        def total(pixels):
            logits = at_least_float32(logits_fn(pixels))
            gap = label_logit(logits, y_target) - label_logit(logits, y)
            return gap.sum(), gap

        (_, gap), grad = jax.value_and_grad(total, has_aux=True)(x_adv)
        return gap, flat(grad)

    def step(_, s: _FabState) -> _FabState:
        gap, w = boundary(s.x_adv)
        # {z : gap + w . (z - x_adv) = 0}: the change of w . z it needs from x_adv and from x.
        shift_from_iterate = -gap
        shift_from_clean = jnp.sum(w * flat(s.x_adv - x), axis=1) - gap
        steps = linf_step_to_hyperplane(
            jnp.concatenate([flat(s.x_adv), flat(x)]),
            jnp.concatenate([w, w]),
            jnp.concatenate([shift_from_iterate, shift_from_clean]),
        )
        d1, d2 = steps[:batch], steps[batch:]
        norm1 = jnp.maximum(jnp.abs(d1).max(axis=1), NORM_FLOOR)
        norm2 = jnp.maximum(jnp.abs(d2).max(axis=1), NORM_FLOOR)
        alpha = per_example(jnp.minimum(norm1 / (norm1 + norm2), alpha_max), x)
        moved = (1.0 - alpha) * (s.x_adv + eta * d1.reshape(x.shape)) + alpha * (
            x + eta * d2.reshape(x.shape)
        )
        moved = jnp.clip(moved, 0.0, 1.0)
        fooled = misclassified(at_least_float32(logits_fn(moved)), y)
        norm = jnp.abs(flat(moved - x)).max(axis=1)
        closer = fooled & (norm < s.best_norm)
        return _FabState(
            x_adv=select_per_example(fooled, x + beta * (moved - x), moved),
            best_adv=select_per_example(closer, moved, s.best_adv),
            best_norm=jnp.where(closer, norm, s.best_norm),
        )

    start = _FabState(x, x, jnp.full((batch,), jnp.inf, jnp.float32))
    final = jax.lax.fori_loop(0, n_iter, step, start)
    return final.best_adv, final.best_norm
