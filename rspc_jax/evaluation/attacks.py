"""White-box L-inf attacks in pure JAX: FGSM and PGD (RSPC's settings), APGD (with EOT for
randomised models) and Patch-Fool (docs/evaluation.md, "Attacks"); FAB-T, Square and the
AutoAttack cascade that runs them live in `fab`, `square` and `autoattack`.

Every attack takes a batch in pixel space [0, 1]; normalisation belongs inside the model
function. Examples are attacked independently (per-example losses are summed, never
averaged over the batch, so each example's gradient is its own), hence a batch may be
sharded over devices. Loop lengths and other constants are static Python values, so every
attack is jittable, e.g.
``jax.jit(functools.partial(pgd, logits_fn, eps=8 / 255, step_size=2 / 255, steps=5))``.
"""

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from rspc_jax import rspc

LogitsFn = Callable[[jax.Array], jax.Array]
RandomisedLogitsFn = Callable[[jax.Array, jax.Array], jax.Array]  # (pixels, key) -> logits
LogitsAndAttentionFn = Callable[[jax.Array], tuple]

DLR_EPS = 1e-12  # denominator guard of both DLR losses ("Attacks: AutoAttack and the DLR losses")
APGD_MOMENTUM = 0.75  # hard-coded in APGD, distinct from the oscillation threshold rho ("Attacks: APGD step by step")


# ----- losses ("Attacks: AutoAttack and the DLR losses") -------------------------------------------------------------


def label_logit(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-example logit of the given class, (B,)."""
    return jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]


def dlr_loss(logits: jax.Array, y: jax.Array) -> jax.Array:
    """Per-example DLR loss -(z_y - max_{i!=y} z_i) / (z_pi1 - z_pi3 + 1e-12), pi = logits
    sorted descending ("Attacks: AutoAttack and the DLR losses"); needs at least 3 classes."""
    top, _ = jax.lax.top_k(logits, 3)
    return -logit_margin(logits, y) / (top[:, 0] - top[:, 2] + DLR_EPS)


def logit_margin(logits: jax.Array, y: jax.Array) -> jax.Array:
    """Per-example z_y - max_{i!=y} z_i: positive iff the label wins (Square's loss, DLR's
    numerator)."""
    top, top_index = jax.lax.top_k(logits, 2)
    best_other = jnp.where(top_index[:, 0] == y, top[:, 1], top[:, 0])
    return label_logit(logits, y) - best_other


def dlr_targeted_loss(logits: jax.Array, y: jax.Array, y_target: jax.Array) -> jax.Array:
    """Per-example targeted DLR loss -(z_y - z_t) / (z_pi1 - (z_pi3 + z_pi4) / 2 + 1e-12)
    ("Attacks: AutoAttack and the DLR losses"); needs at least 4 classes."""
    top, _ = jax.lax.top_k(logits, 4)
    margin = label_logit(logits, y) - label_logit(logits, y_target)
    return -margin / (top[:, 0] - 0.5 * (top[:, 2] + top[:, 3]) + DLR_EPS)


# ----- shared helpers -------------------------------------------------------------------


def project_linf(x_adv: jax.Array, x: jax.Array, eps: float) -> jax.Array:
    """Clip to the L-inf eps-ball around x, then to the pixel range [0, 1]."""
    return jnp.clip(jnp.clip(x_adv, x - eps, x + eps), 0.0, 1.0)


def per_example(values: jax.Array, like: jax.Array) -> jax.Array:
    """Reshape a (B,) vector to broadcast against a (B, ...) batch."""
    return values.reshape(values.shape + (1,) * (like.ndim - 1))


def select_per_example(condition: jax.Array, if_true: jax.Array, if_false: jax.Array) -> jax.Array:
    """Per-example jnp.where: condition is (B,), the operands (B, ...)."""
    return jnp.where(per_example(condition, if_true), if_true, if_false)


def at_least_float32(values: jax.Array) -> jax.Array:
    """Losses are computed in float32 (or wider) whatever the model's dtype."""
    return values.astype(jnp.promote_types(values.dtype, jnp.float32))


def _losses_logits_grad(logits_fn: LogitsFn, loss_fn, x_adv: jax.Array, y: jax.Array):
    """Per-example losses, the logits and the gradient of the summed loss, i.e. every
    example's own gradient."""

    def total(x_adv):
        logits = at_least_float32(logits_fn(x_adv))
        losses = loss_fn(logits, y)
        return losses.sum(), (losses, logits)

    (_, (losses, logits)), grad = jax.value_and_grad(total, has_aux=True)(x_adv)
    return losses, logits, grad


def _eot_losses_logits_grad(
    logits_fn: RandomisedLogitsFn, loss_fn, x_adv: jax.Array, y: jax.Array, rng, eot_iter: int
):
    """Expectation over transformation for a randomised model logits_fn(pixels, key): the
    gradient averaged over `eot_iter` draws; losses and logits of the last draw, as
    AutoAttack's `rand` version uses them ("Attacks: the AutoAttack cascade")."""

    def draw(grad_sum, key):
        losses, logits, grad = _losses_logits_grad(
            lambda pixels: logits_fn(pixels, key), loss_fn, x_adv, y
        )
        return grad_sum + grad, (losses, logits)

    grad_sum, (losses, logits) = jax.lax.scan(
        draw, jnp.zeros_like(x_adv), jax.random.split(rng, eot_iter)
    )
    return losses[-1], logits[-1], grad_sum / eot_iter


def misclassified(logits: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.argmax(logits, axis=-1) != y


# ----- FGSM / PGD ("Attacks: FGSM and PGD") ---------------------------------------------------------


def signed_ascent(
    loss_fn: Callable[[jax.Array], jax.Array],
    x: jax.Array,
    start: jax.Array,
    *,
    eps,
    step_size,
    steps: int,
) -> jax.Array:
    """PGD's loop, shared with adversarial training: `steps` steps
    x_adv <- proj(x_adv + step_size * sign(grad loss_fn(x_adv))) from `start`, each projected
    to the eps-ball around x and to [0, 1]. loss_fn(x_adv) is the per-example loss summed
    over the batch, so every example's gradient is its own. The last iterate is returned as
    a constant (no gradient flows back through the attack)."""

    def step(_, x_adv):
        return project_linf(x_adv + step_size * jnp.sign(jax.grad(loss_fn)(x_adv)), x, eps)

    return jax.lax.stop_gradient(jax.lax.fori_loop(0, steps, step, start))


def pgd(
    logits_fn: LogitsFn,
    x: jax.Array,
    y: jax.Array,
    rng: jax.Array | None,
    *,
    eps: float,
    step_size: float,
    steps: int,
    random_start: bool = True,
) -> jax.Array:
    """L-inf PGD on CE as RSPC's `--pgd_test` ("Attacks: FGSM and PGD"; RSPC: eps 8/255, step 2/255,
    5 steps): optional uniform start in [-eps, eps] clipped to [0, 1], then sign-gradient
    steps, each projected to the eps-ball and [0, 1]. Returns the last iterate (no early
    stop, no best-iterate tracking, as RSPC). `rng` is only used for the random start."""
    start = x
    if random_start:
        start = jnp.clip(x + jax.random.uniform(rng, x.shape, x.dtype, -eps, eps), 0.0, 1.0)

    def loss_fn(x_adv):
        return rspc.per_example_cross_entropy(logits_fn(x_adv), y).sum()

    return signed_ascent(loss_fn, x, start, eps=eps, step_size=step_size, steps=steps)


def fgsm(logits_fn: LogitsFn, x: jax.Array, y: jax.Array, *, eps: float) -> jax.Array:
    """One sign-gradient CE step of size eps from the clean input, as RSPC's
    `--fgsm_test` (= its PGD routine with 1 step and no random start; "Attacks: FGSM and PGD")."""
    return pgd(logits_fn, x, y, None, eps=eps, step_size=eps, steps=1, random_start=False)


# ----- APGD ("Attacks: APGD step by step") ---------------------------------------------------------------


def _apgd_schedule(n_iter: int) -> list:
    """(0-based iteration, window length k) of every APGD checkpoint: the first window is
    n_iter_2 long, each next one size_decr shorter but at least n_iter_min ("Attacks: APGD step by step", step 1)."""
    n_iter_2 = max(int(0.22 * n_iter), 1)
    n_iter_min = max(int(0.06 * n_iter), 1)
    size_decr = max(int(0.03 * n_iter), 1)
    schedule, iteration, window = [], n_iter_2 - 1, n_iter_2
    while iteration < n_iter:
        schedule.append((iteration, window))
        window = max(window - size_decr, n_iter_min)
        iteration += window
    return schedule


def _apgd_checkpoint_table(n_iter: int) -> tuple[jax.Array, jax.Array]:
    """Per iteration: whether it is a checkpoint, and the window length it checks."""
    is_checkpoint = [False] * n_iter
    window_at = [0] * n_iter
    for iteration, window in _apgd_schedule(n_iter):
        is_checkpoint[iteration], window_at[iteration] = True, window
    return jnp.array(is_checkpoint), jnp.array(window_at)


def apgd_checkpoints(n_iter: int) -> list:
    """The 0-based iterations after which APGD checks its step size ("Attacks: APGD step by step", step 1);
    for n_iter = 100: [21, 40, 56, 69, 79, 86, 92, 98]."""
    return [iteration for iteration, _ in _apgd_schedule(n_iter)]


def _apgd_loss_fn(loss: str, y_target: jax.Array | None):
    """The per-example loss(logits, y) that APGD maximises."""
    if loss == "ce":
        return rspc.per_example_cross_entropy
    if loss == "dlr":
        return dlr_loss
    if loss == "dlr_targeted":
        if y_target is None:
            raise ValueError("loss='dlr_targeted' needs y_target")
        return lambda logits, y: dlr_targeted_loss(logits, y, y_target)
    raise ValueError(f"unknown APGD loss {loss!r}; expected 'ce', 'dlr' or 'dlr_targeted'")


def _oscillating(
    loss_steps: jax.Array, iteration: jax.Array, window: jax.Array, rho: float
) -> jax.Array:
    """ "Attacks: APGD step by step", condition 1: at most window * rho of the last `window` steps increased the loss
    (the code's <=). jnp.roll makes step 0 compare with the still-zero last slot, which is
    the reference's loss_steps[-1] at the first checkpoint."""
    increased = loss_steps > jnp.roll(loss_steps, 1, axis=0)
    steps = jnp.arange(loss_steps.shape[0])
    in_window = (steps > iteration - window) & (steps <= iteration)
    return jnp.sum(increased & in_window[:, None], axis=0) <= window * rho


class _ApgdState(NamedTuple):
    x_adv: jax.Array
    x_old: jax.Array
    grad: jax.Array
    step_size: jax.Array  # (B,)
    x_best: jax.Array
    grad_best: jax.Array
    loss_best: jax.Array  # (B,)
    x_best_adv: jax.Array
    robust: jax.Array  # (B,) never misclassified so far
    loss_steps: jax.Array  # (n_iter, B)
    reduced_last_check: jax.Array
    loss_best_last_check: jax.Array


def _apgd_init(evaluate, x, y, rng, eps, n_iter) -> _ApgdState:
    """ "Attacks: APGD step by step", step 2: x0 = x + eps * t / max|t|, t ~ U(-1, 1) per example, clipped to [0, 1];
    step size 2 * eps; loss, gradient and prediction at x0 (`evaluate` at iteration -1)."""
    t = jax.random.uniform(rng, x.shape, x.dtype, -1.0, 1.0)
    t_max = jnp.max(jnp.abs(t.reshape(x.shape[0], -1)), axis=1)
    x0 = jnp.clip(x + eps * t / per_example(t_max, x), 0.0, 1.0)
    losses, logits, grad = evaluate(x0, -1)
    return _ApgdState(
        x_adv=x0,
        x_old=x0,
        grad=grad,
        step_size=jnp.full(losses.shape, 2.0 * eps),
        x_best=x0,
        grad_best=grad,
        loss_best=losses,
        x_best_adv=x0,
        robust=~misclassified(logits, y),
        loss_steps=jnp.zeros((n_iter,) + losses.shape, losses.dtype),
        reduced_last_check=jnp.ones(losses.shape, bool),
        loss_best_last_check=losses,
    )


def apgd(
    logits_fn: LogitsFn,
    x: jax.Array,
    y: jax.Array,
    rng: jax.Array,
    *,
    eps: float,
    n_iter: int = 100,
    loss: str = "ce",
    y_target: jax.Array | None = None,
    rho: float = 0.75,
    eot_iter: int | None = None,
):
    """One restart of L-inf APGD exactly as docs/evaluation.md, "Attacks: APGD step by step" (Croce & Hein 2020, `attack_single_run`).

    Momentum step with a = 1 at i = 0 and 0.75 after; at each checkpoint the step size of an
    example halves when its loss oscillated (condition 1, with the first-checkpoint quirk)
    or when it was not halved at the previous checkpoint and its best loss has not improved
    since (condition 2); halved examples restart from x_best with grad_best while x_old is
    kept (the reference's momentum quirk). Losses: 'ce', 'dlr', 'dlr_targeted' (needs
    y_target); success always means argmax != y. Restarts are left to the caller.
    With eot_iter = n (AutoAttack's `rand` version: 20) logits_fn is a randomised model
    logits_fn(pixels, key) and every gradient is the mean over n fresh draws.

    Returns (x_best_adv, robust): robust = never misclassified during the run;
    x_best_adv = the last misclassified iterate, or the random start where robust.
    """
    loss_fn = _apgd_loss_fn(loss, y_target)
    if eot_iter is None:

        def evaluate(x_adv, iteration):
            return _losses_logits_grad(logits_fn, loss_fn, x_adv, y)
    else:
        rng, eot_rng = jax.random.split(rng)

        def evaluate(x_adv, iteration):
            key = jax.random.fold_in(eot_rng, iteration + 1)
            return _eot_losses_logits_grad(logits_fn, loss_fn, x_adv, y, key, eot_iter)

    is_checkpoint, window_at = _apgd_checkpoint_table(n_iter)

    def step(i, s: _ApgdState) -> _ApgdState:
        momentum = jnp.where(i > 0, APGD_MOMENTUM, 1.0).astype(x.dtype)
        z = project_linf(s.x_adv + per_example(s.step_size, x) * jnp.sign(s.grad), x, eps)
        x_new = project_linf(
            s.x_adv + momentum * (z - s.x_adv) + (1.0 - momentum) * (s.x_adv - s.x_old), x, eps
        )
        losses, logits, grad = evaluate(x_new, i)
        fooled = misclassified(logits, y)
        improved = losses > s.loss_best
        x_best = select_per_example(improved, x_new, s.x_best)
        grad_best = select_per_example(improved, grad, s.grad_best)
        loss_best = jnp.where(improved, losses, s.loss_best)
        loss_steps = s.loss_steps.at[i].set(losses)

        checkpoint = is_checkpoint[i]
        no_improvement = ~s.reduced_last_check & (s.loss_best_last_check >= loss_best)
        reduce_now = _oscillating(loss_steps, i, window_at[i], rho) | no_improvement
        reduce = checkpoint & reduce_now
        return _ApgdState(
            x_adv=select_per_example(reduce, x_best, x_new),
            x_old=s.x_adv,
            grad=select_per_example(reduce, grad_best, grad),
            step_size=jnp.where(reduce, s.step_size / 2.0, s.step_size),
            x_best=x_best,
            grad_best=grad_best,
            loss_best=loss_best,
            x_best_adv=select_per_example(fooled, x_new, s.x_best_adv),
            robust=s.robust & ~fooled,
            loss_steps=loss_steps,
            reduced_last_check=jnp.where(checkpoint, reduce_now, s.reduced_last_check),
            loss_best_last_check=jnp.where(checkpoint, loss_best, s.loss_best_last_check),
        )

    state = _apgd_init(evaluate, x, y, rng, eps, n_iter)
    state = jax.lax.fori_loop(0, n_iter, step, state)
    return state.x_best_adv, state.robust


def autoattack_targets(clean_logits: jax.Array, n_target_classes: int) -> jax.Array:
    """(n_target_classes, B) targets of APGD-T and FAB-T: the 2nd .. (n_target_classes + 1)-th
    highest clean logit of every example ("Attacks: AutoAttack and the DLR losses")."""
    _, ranked = jax.lax.top_k(clean_logits, n_target_classes + 1)
    return ranked[:, 1:].T


# ----- Patch-Fool ("Attacks: Patch-Fool") -----------------------------------------------------------


def select_patches(attention: jax.Array, num_patches: int, num_patch_tokens: int) -> jax.Array:
    """Patch-Fool's `Attn` selection ("Attacks: Patch-Fool"): the (B, num_patches) indices of the
    patches that receive the most attention = post-softmax attention (B, heads, N, N)
    averaged over heads and queries, the leading prefix tokens (CLS, ...) dropped; most
    attended first."""
    received = attention.mean(axis=(1, 2))[:, attention.shape[-1] - num_patch_tokens :]
    return jax.lax.top_k(received, num_patches)[1]


def patch_mask(patches: jax.Array, image_shape: Sequence[int], patch_size: int) -> jax.Array:
    """(B, H, W, 1) bool mask, True on the given row-major patch indices (B, num_patches)."""
    grid = (image_shape[1] // patch_size, image_shape[2] // patch_size)
    on = jax.nn.one_hot(patches, grid[0] * grid[1], dtype=bool).any(axis=1)
    return rspc.patch_mask_to_pixels(on, grid, patch_size)


def _project_conflicting(g_att: jax.Array, g_ce: jax.Array) -> jax.Array:
    """Patch-Fool's PCGrad step, per example: where cos(g_att, g_ce) < 0, subtract
    (g_att . g_ce / ||g_ce||) g_ce. The reference divides by ||g_ce||, not ||g_ce||^2 (a
    quirk kept on purpose, "Attacks: Patch-Fool")."""
    axes = tuple(range(1, g_ce.ndim))
    dot = jnp.sum(g_att * g_ce, axis=axes, keepdims=True)
    norm = jnp.sqrt(jnp.sum(g_ce * g_ce, axis=axes, keepdims=True))
    return jnp.where(dot < 0, g_att - dot / jnp.where(norm > 0, norm, 1.0) * g_ce, g_att)


def _attention_loss(attention: jax.Array, target_token: jax.Array) -> jax.Array:
    """Per-example Patch-Fool attention loss: log of the head-mean attention every query
    pays to the target token, averaged over queries (= NLL(-log A, target), "Attacks: Patch-Fool")."""
    received = jnp.take_along_axis(attention.mean(axis=1), target_token[:, None, None], axis=2)
    return jnp.log(received[..., 0]).mean(axis=1)


def patch_fool(
    logits_and_attention_fn: LogitsAndAttentionFn,
    x: jax.Array,
    y: jax.Array,
    rng: jax.Array,
    *,
    patch_size: int,
    std: Sequence[float],
    num_patches: int = 1,
    attention_block: int = 4,
    steps: int = 250,
    lr: float = 0.22,
    step_decay_every: int = 10,
    gamma: float = 0.95,
    attention_weight: float = 0.002,
    mode: str = "attention",
    reference_batch_size: int = 64,
) -> jax.Array:
    """Vanilla Patch-Fool (Fu et al. 2022; "Attacks: Patch-Fool") on a batch in pixel space [0, 1].

    The `num_patches` most attended patches at block `attention_block` are replaced by a
    free patch (uniform random start, no norm bound, clipped to the valid range after every
    step) trained for `steps` Adam ascent steps, the learning rate decaying x`gamma` every
    `step_decay_every` steps. mode='attention' adds the attention loss of blocks
    1 .. L//2 - 1 (pushing every query to the first selected patch) with the reference's
    PCGrad projection and weight; mode='ce' ascends CE only. Returns the final input.

    Equivalence to the reference, which optimises delta in normalised space: the variable
    here is u = delta_pixel / std, which differs from the normalised delta by the constant
    mean / std, so its gradients, Adam steps (lr in normalised units) and clipping range
    [0, 1/std] are the reference's; only `std` is needed. Per-example losses are scaled by
    1 / reference_batch_size, the reference's batch mean at its batch size 64, because the
    PCGrad quirk is not scale invariant; examples stay independent of the actual batch.
    """
    if mode not in ("attention", "ce"):
        raise ValueError(f"unknown Patch-Fool mode {mode!r}; expected 'attention' or 'ce'")
    _, height, width, _ = x.shape
    num_patch_tokens = (height // patch_size) * (width // patch_size)
    _, clean_attention = logits_and_attention_fn(x)
    patches = select_patches(clean_attention[attention_block], num_patches, num_patch_tokens)
    mask = patch_mask(patches, x.shape, patch_size)
    num_prefix = clean_attention[attention_block].shape[-1] - num_patch_tokens
    target_token = patches[:, 0] + num_prefix
    attention_blocks = range(1, len(clean_attention) // 2) if mode == "attention" else ()
    std = jnp.asarray(std, x.dtype)
    scale = 1.0 / reference_batch_size

    def paste(u):
        return jnp.where(mask, jnp.clip(u * std, 0.0, 1.0), x)

    def objectives(u):
        """[CE, attention loss of each block in attention_blocks], summed over the batch."""
        logits, attention = logits_and_attention_fn(paste(u))
        terms = [rspc.per_example_cross_entropy(logits, y)]
        terms += [
            _attention_loss(at_least_float32(attention[block]), target_token)
            for block in attention_blocks
        ]
        return scale * jnp.stack([term.sum() for term in terms])

    def ascent_direction(u):
        values, pullback = jax.vjp(objectives, u)
        basis = jnp.eye(values.shape[0], dtype=values.dtype)
        g_ce, *g_att = [pullback(row)[0] for row in basis]
        return g_ce + attention_weight * sum(_project_conflicting(g, g_ce) for g in g_att)

    optimizer = optax.adam(optax.exponential_decay(lr, step_decay_every, gamma, staircase=True))

    def step(_, carry):
        u, opt_state = carry
        updates, opt_state = optimizer.update(-ascent_direction(u), opt_state)
        return jnp.clip(optax.apply_updates(u, updates), 0.0, 1.0 / std), opt_state

    u0 = jax.random.uniform(rng, x.shape, x.dtype) / std
    u, _ = jax.lax.fori_loop(0, steps, step, (u0, optimizer.init(u0)))
    return paste(u)
