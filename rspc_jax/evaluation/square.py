"""L-inf Square Attack (Andriushchenko et al., "Square Attack: a query-efficient black-box
adversarial attack via random search", ECCV 2020) as AutoAttack runs it (docs/evaluation.md,
"Attacks: Square").

Score-based: it only queries logits, so it still works where gradients are masked. Random
search over the vertices of the eps-ball: start from vertical stripes of +-eps, then each
query redraws one square window with a random sign per channel and keeps it if the margin
loss drops. Pixels in [0, 1], NHWC; every example draws its own windows and signs, so a
batch may be sharded like the other attacks.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from rspc_jax.evaluation.attacks import (
    LogitsFn,
    at_least_float32,
    logit_margin,
    project_linf,
    select_per_example,
)

# Iterations after which p halves again (p_init / 2 after 10, / 4 after 50, ...); the
# schedule is written for 10,000 queries.
P_HALVING_AFTER = (10, 50, 200, 500, 1000, 2000, 4000, 6000, 8000)
SCHEDULE_QUERIES = 10_000


def square_fraction(
    iteration: jax.Array, *, p_init: float, n_queries: int, rescale_schedule: bool
) -> jax.Array:
    """p, the fraction of the image's pixels a window covers, at a 0-based iteration:
    p_init halved once for every entry of P_HALVING_AFTER that the iteration exceeds.
    rescale_schedule maps the iteration onto the 10,000-query schedule first (the paper's
    code); AutoAttack runs it unscaled (`resc_schedule=False`)."""
    if rescale_schedule:
        iteration = (iteration * SCHEDULE_QUERIES) // n_queries
    halvings = jnp.sum(iteration > jnp.asarray(P_HALVING_AFTER))
    return p_init / 2.0**halvings


def window_side(p: jax.Array, height: int, width: int) -> jax.Array:
    """The square's side: round(sqrt(p * h * w)), at least 1 and at most h - 1."""
    return jnp.clip(jnp.round(jnp.sqrt(p * height * width)), 1, height - 1).astype(jnp.int32)


class _SquareState(NamedTuple):
    iteration: jax.Array
    x_best: jax.Array
    margin_best: jax.Array  # (B,) z_y - max_{i!=y} z_i at x_best; <= 0 means fooled
    queries: jax.Array  # (B,) model queries spent on each example


def square(
    logits_fn: LogitsFn,
    x: jax.Array,
    y: jax.Array,
    rng: jax.Array,
    *,
    eps: float,
    n_queries: int = 5000,
    p_init: float = 0.8,
    rescale_schedule: bool = False,
    attack: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One restart of L-inf Square on the margin loss z_y - max_{i!=y} z_i.

    Start: x + eps * s clipped to [0, 1], s = +-1 per example, channel and column (vertical
    stripes). Iteration i < n_queries (while any attacked example is still classified
    correctly): every such example draws a window of side window_side(p_i) whose top-left
    corner is uniform in {0 .. h - s - 1} x {0 .. w - s - 1} (the reference's range) and a
    sign per channel, adds 2 eps * sign inside the window to its best point, projects to the
    eps-ball and [0, 1], and keeps the result if its margin is lower. `attack` (B,) bool
    restricts the search and the query count to those examples (the cascade passes the
    points still robust); the others count no queries.

    Returns (x_best, robust, queries): robust = margin still positive; queries = model
    evaluations spent per example, the start included.
    """
    batch, height, width, channels = x.shape
    attack = jnp.ones((batch,), bool) if attack is None else attack
    stripes_key, search_key = jax.random.split(rng)

    def margin(pixels):
        return logit_margin(at_least_float32(logits_fn(pixels)), y)

    def searching(s: _SquareState):
        return attack & (s.margin_best > 0)

    def keep_going(s: _SquareState):
        return (s.iteration < n_queries) & jnp.any(searching(s))

    def step(s: _SquareState) -> _SquareState:
        active = searching(s)
        side = window_side(
            square_fraction(
                s.iteration,
                p_init=p_init,
                n_queries=n_queries,
                rescale_schedule=rescale_schedule,
            ),
            height,
            width,
        )
        row_key, col_key, sign_key = jax.random.split(
            jax.random.fold_in(search_key, s.iteration), 3
        )
        top = jax.random.randint(row_key, (batch, 1, 1, 1), 0, height - side)
        left = jax.random.randint(col_key, (batch, 1, 1, 1), 0, width - side)
        rows = jnp.arange(height)[None, :, None, None]
        cols = jnp.arange(width)[None, None, :, None]
        inside = (rows >= top) & (rows < top + side) & (cols >= left) & (cols < left + side)
        signs = jax.random.rademacher(sign_key, (batch, 1, 1, channels), x.dtype)
        candidate = project_linf(s.x_best + jnp.where(inside, 2.0 * eps * signs, 0.0), x, eps)
        candidate_margin = margin(candidate)
        better = active & (candidate_margin < s.margin_best)
        return _SquareState(
            iteration=s.iteration + 1,
            x_best=select_per_example(better, candidate, s.x_best),
            margin_best=jnp.where(better, candidate_margin, s.margin_best),
            queries=s.queries + active,
        )

    stripes = jax.random.rademacher(stripes_key, (batch, 1, width, channels), x.dtype)
    x_start = jnp.clip(x + eps * stripes, 0.0, 1.0)
    start = _SquareState(
        iteration=jnp.array(0, jnp.int32),
        x_best=x_start,
        margin_best=margin(x_start),
        queries=attack.astype(jnp.int32),
    )
    final = jax.lax.while_loop(keep_going, step, start)
    return final.x_best, final.margin_best > 0, final.queries
