"""White-box attacks (docs/evaluation.md, "Attacks") on tiny models: budgets, attack
strength ordering, APGD's schedule and step-size logic against a loop transcription of 6.3,
analytic worst cases of linear models, the DLR formulas, FAB-T's minimal norms and
projection, Square's success exactly where an adversarial example exists, the AutoAttack
cascade's stage bookkeeping, EOT and Patch-Fool's patch choice."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rspc_jax import rspc
from rspc_jax.evaluation import attacks, autoattack, fab, square

D = 8 * 8 * 3
K = 5
B = 64


def _linear(seed, num_classes=K):
    rs = np.random.RandomState(seed)
    w = rs.randn(D, num_classes).astype(np.float32)
    b = rs.randn(num_classes).astype(np.float32)
    return w, b, lambda x: x.reshape(x.shape[0], -1) @ w + b


def _mlp_params(seed, dtype=np.float32, hidden=16, scale=8.0):
    rs = np.random.RandomState(seed)
    w1 = (rs.randn(D, hidden) * scale / np.sqrt(D)).astype(dtype)
    w2 = (rs.randn(hidden, K) * scale / np.sqrt(hidden)).astype(dtype)
    return w1, w2, np.full(D, 0.5, dtype) @ w1


def _mlp(params):
    w1, w2, centre = params
    return lambda x: jnp.tanh(x.reshape(x.shape[0], -1) @ w1 - centre) @ w2


def _images(seed, batch=B):
    return np.random.RandomState(seed).rand(batch, 8, 8, 3).astype(np.float32)


def _accuracy(logits_fn, x, y):
    return float(np.mean(np.argmax(np.asarray(logits_fn(x)), -1) == y))


@pytest.fixture(scope="module")
def mlp_attacks():
    """A tanh MLP on which FGSM, PGD, APGD and the cascade differ; every attack jitted
    once with eps as a traced argument."""
    model = _mlp(_mlp_params(2))
    x = _images(3)
    y = np.argmax(np.asarray(model(x)), -1)  # clean accuracy 100 %
    jit = {
        "fgsm": jax.jit(lambda x, y, rng, eps: attacks.fgsm(model, x, y, eps=eps)),
        # 10 steps of eps/4 can cross the ball; RSPC's 5 from a random start cannot
        # everywhere, and such a PGD can be weaker than FGSM on near-linear models.
        "pgd": jax.jit(
            lambda x, y, rng, eps: attacks.pgd(
                model, x, y, rng, eps=eps, step_size=eps / 4, steps=10
            )
        ),
        "apgd": jax.jit(lambda x, y, rng, eps: attacks.apgd(model, x, y, rng, eps=eps)[0]),
        "apgd_dlr": jax.jit(
            lambda x, y, rng, eps: attacks.apgd(model, x, y, rng, eps=eps, loss="dlr")[0]
        ),
        "autoattack": jax.jit(
            lambda x, y, rng, eps: autoattack.autoattack(
                model, x, y, rng, eps=eps, n_target_classes=K - 1, n_queries=300
            ).robust["square"]
        ),
    }
    return model, x, y, jit


def _robust_accuracy(mlp_attacks, name, eps, rng=None):
    model, x, y, jit = mlp_attacks
    rng = jax.random.PRNGKey(0) if rng is None else rng
    out = jit[name](x, y, rng, eps)
    if name == "autoattack":
        return float(np.mean(out))
    return _accuracy(model, out, y)


@pytest.mark.parametrize("name", ["fgsm", "pgd", "apgd", "apgd_dlr"])
def test_perturbations_stay_in_the_eps_ball_and_pixel_range(mlp_attacks, name):
    model, _, _, jit = mlp_attacks
    x = _images(4)
    x[:, :, :4] = 0.0  # pixels at the range limits
    x[:, :, 4:6] = 1.0
    y = np.argmax(np.asarray(model(x)), -1)
    eps = 8 / 255
    x_adv = np.asarray(jit[name](x, y, jax.random.PRNGKey(1), eps))
    assert np.abs(x_adv - x).max() <= eps + 1e-6
    assert x_adv.min() >= 0.0 and x_adv.max() <= 1.0
    assert np.abs(x_adv - x).max() > eps / 2  # it did move


def test_stronger_attacks_give_lower_accuracy(mlp_attacks):
    eps = 4 / 255
    acc = {
        name: _robust_accuracy(mlp_attacks, name, eps)
        for name in ("fgsm", "pgd", "apgd", "autoattack")
    }
    assert acc["pgd"] < acc["fgsm"] < 1.0, acc
    assert acc["autoattack"] <= acc["apgd"] < acc["pgd"], acc


@pytest.mark.parametrize("name", ["fgsm", "pgd", "apgd", "autoattack"])
def test_a_larger_budget_never_raises_robust_accuracy(mlp_attacks, name):
    acc = [_robust_accuracy(mlp_attacks, name, eps) for eps in (1 / 255, 2 / 255, 4 / 255)]
    assert acc[0] >= acc[1] >= acc[2], acc
    assert acc[2] < acc[0], acc


def _counter_checkpoints(n_iter):
    """The checkpoints as the reference's counter loop finds them (6.3 step 1)."""
    k, counter, checks = max(int(0.22 * n_iter), 1), 0, []
    for i in range(n_iter):
        counter += 1
        if counter == k:
            checks.append(i)
            k, counter = max(k - max(int(0.03 * n_iter), 1), max(int(0.06 * n_iter), 1)), 0
    return checks


def test_apgd_checkpoints():
    assert attacks.apgd_checkpoints(100) == [21, 40, 56, 69, 79, 86, 92, 98]
    assert [i + 1 for i in attacks.apgd_checkpoints(100)] == [22, 41, 57, 70, 80, 87, 93, 99]
    for n_iter in (5, 10, 37, 250):
        assert attacks.apgd_checkpoints(n_iter) == _counter_checkpoints(n_iter)


def _reference_apgd(loss_grad_pred, x, y, x0, eps, n_iter, rho=0.75):
    """6.3 transcribed as a plain loop over numpy arrays; also counts the step-size
    halvings due to oscillation and to condition 2 alone."""

    def project(v):
        return np.clip(np.clip(v, x - eps, x + eps), 0.0, 1.0)

    loss, grad, pred = loss_grad_pred(x0)
    x_adv, x_old, x_best, x_best_adv = x0.copy(), x0.copy(), x0.copy(), x0.copy()
    loss_best, grad_best = loss.copy(), grad.copy()
    eta = np.full(len(x), 2 * eps)
    robust = pred == y
    loss_steps = np.zeros((n_iter, len(x)))
    reduced_last, loss_best_last = np.ones(len(x), bool), loss_best.copy()
    k, counter, n_osc, n_cond2 = max(int(0.22 * n_iter), 1), 0, 0, 0
    for i in range(n_iter):
        a = 0.75 if i > 0 else 1.0
        z = project(x_adv + eta[:, None, None, None] * np.sign(grad))
        x_old, x_adv = x_adv, project(x_adv + a * (z - x_adv) + (1 - a) * (x_adv - x_old))
        loss, grad, pred = loss_grad_pred(x_adv)
        robust &= pred == y
        x_best_adv[pred != y] = x_adv[pred != y]
        loss_steps[i] = loss
        better = loss > loss_best
        x_best[better], grad_best[better] = x_adv[better], grad[better]
        loss_best[better] = loss[better]
        counter += 1
        if counter == k:
            # Python's index -1 is the still-zero last slot at the first checkpoint.
            ups = sum((loss_steps[i - c] > loss_steps[i - c - 1]).astype(int) for c in range(k))
            oscillating = ups <= k * rho
            cond2 = ~reduced_last & (loss_best_last >= loss_best)
            reduce = oscillating | cond2
            n_osc, n_cond2 = n_osc + oscillating.sum(), n_cond2 + (cond2 & ~oscillating).sum()
            reduced_last, loss_best_last = reduce, loss_best.copy()
            eta[reduce] /= 2
            x_adv[reduce], grad[reduce] = x_best[reduce], grad_best[reduce]
            k, counter = max(k - max(int(0.03 * n_iter), 1), max(int(0.06 * n_iter), 1)), 0
    return x_best_adv, robust, n_osc, n_cond2


@pytest.mark.parametrize("loss, rho", [("ce", 0.5), ("dlr", 0.75)])
def test_apgd_follows_the_reference_loop(loss, rho):
    """Same random start (the implementation's draw), float64 so the two runs take the
    same branches: identical robust flags and adversarial examples. The rho values make
    both halving rules fire on this model."""
    eps, n_iter, rng = 4 / 255, 100, jax.random.PRNGKey(5)
    loss_fn = {"ce": rspc.per_example_cross_entropy, "dlr": attacks.dlr_loss}[loss]
    with jax.enable_x64(True):
        model = _mlp(_mlp_params(2, np.float64))
        x = _images(6, batch=32).astype(np.float64)
        y = np.argmax(np.asarray(model(x)), -1)
        ours_adv, ours_robust = jax.jit(
            lambda x, y, rng: attacks.apgd(
                model, x, y, rng, eps=eps, n_iter=n_iter, loss=loss, rho=rho
            )
        )(x, y, rng)

        def total(x_adv):
            logits = model(x_adv)
            return loss_fn(logits, y).sum(), (loss_fn(logits, y), jnp.argmax(logits, -1))

        grad_fn = jax.jit(jax.grad(total, has_aux=True))

        def loss_grad_pred(x_adv):
            grad, (losses, pred) = grad_fn(x_adv)
            return np.array(losses), np.array(grad), np.array(pred)

        t = np.asarray(jax.random.uniform(rng, x.shape, jnp.float64, -1.0, 1.0))
        x0 = np.clip(x + eps * t / np.abs(t).reshape(len(x), -1).max(1)[:, None, None, None], 0, 1)
        ref_adv, ref_robust, n_osc, n_cond2 = _reference_apgd(
            loss_grad_pred, x, y, x0, eps, n_iter, rho
        )
    assert n_osc > 0 and n_cond2 > 0, (n_osc, n_cond2)  # both halving rules exercised
    assert 0 < ref_robust.sum() < len(x)
    np.testing.assert_array_equal(np.asarray(ours_robust), ref_robust)
    np.testing.assert_allclose(np.asarray(ours_adv), ref_adv, atol=1e-9)


def _linear_worst_margin(w, b, x, y, eps):
    """min over the eps-ball and [0, 1] of z_y - z_k, per class k != y: the minimiser moves
    every pixel by eps against sign(w_y - w_k), then clips to [0, 1]."""
    flat = x.reshape(len(x), -1).astype(np.float64)
    margins = []
    for k in range(w.shape[1]):
        d = w[:, y].T.astype(np.float64) - w[:, k]
        margin = (d * np.clip(flat - eps * np.sign(d), 0, 1)).sum(1) + b[y] - b[k]
        margins.append(np.where(y == k, np.inf, margin))
    return np.min(margins, axis=0)


@pytest.mark.parametrize("loss", ["ce", "dlr"])
def test_apgd_reaches_the_analytic_worst_case_of_a_binary_linear_model(loss):
    """Classes 0 and 1 compete; class 2 (needed by DLR) is never close."""
    w, b, _ = _linear(7, num_classes=3)
    w[:, 2], b[2] = 0.0, -1e3
    x = _images(8)
    eps = 4 / 255
    flat = x.reshape(len(x), -1)
    b[1] = b[0] + np.median(flat @ (w[:, 0] - w[:, 1]))  # about half the points per class
    model = lambda v: v.reshape(v.shape[0], -1) @ w + b
    y = np.argmax(np.asarray(model(x)), -1)
    worst = _linear_worst_margin(w, b, x, y, eps)
    x_adv, robust = attacks.apgd(model, x, y, jax.random.PRNGKey(9), eps=eps, loss=loss)
    assert 0 < (worst > 0).sum() < len(x)
    np.testing.assert_array_equal(np.asarray(robust), worst > 0)
    fooled = ~np.asarray(robust)
    assert np.all(np.argmax(np.asarray(model(x_adv)), -1)[fooled] != y[fooled])


def test_autoattack_targets_are_the_2nd_to_10th_highest_clean_logits():
    z = np.random.RandomState(0).permutation(12 * 3).reshape(3, 12).astype(np.float32)
    targets = np.asarray(attacks.autoattack_targets(z, 9))
    assert targets.shape == (9, 3)
    np.testing.assert_array_equal(targets.T, np.argsort(-z, axis=1)[:, 1:10])


def _np_dlr(z, y):
    s = np.sort(z, axis=1)
    z_y = z[np.arange(len(z)), y]
    masked = z.copy()
    masked[np.arange(len(z)), y] = -np.inf
    return -(z_y - masked.max(1)) / (s[:, -1] - s[:, -3] + 1e-12)


def _np_dlr_targeted(z, y, t):
    s = np.sort(z, axis=1)
    rows = np.arange(len(z))
    return -(z[rows, y] - z[rows, t]) / (s[:, -1] - 0.5 * (s[:, -3] + s[:, -4]) + 1e-12)


def test_dlr_losses_match_the_formulas():
    rs = np.random.RandomState(0)
    z = rs.randn(32, 10).astype(np.float32) * 3
    y = rs.randint(0, 10, 32)
    y[:16] = z[:16].argmax(1)  # both branches of max_{i != y}
    t = (y + rs.randint(1, 10, 32)) % 10
    np.testing.assert_allclose(attacks.dlr_loss(z, y), _np_dlr(z, y), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        attacks.dlr_targeted_loss(z, y, t), _np_dlr_targeted(z, y, t), rtol=1e-5, atol=1e-6
    )


# ----- EOT, FAB-T, Square and the AutoAttack cascade ------------------------------------


def _binary_linear(seed, images_seed):
    """Classes 0 and 1 compete (about half the points each), class 2 is never close."""
    w, b, _ = _linear(seed, num_classes=3)
    w[:, 2], b[2] = 0.0, -1e3
    x = _images(images_seed)
    b[1] = b[0] + np.median(x.reshape(len(x), -1) @ (w[:, 0] - w[:, 1]))
    return w, b, x, lambda v: v.reshape(v.shape[0], -1) @ w + b


def _noisy_gradients(model, scale=3.0):
    """A randomised model(pixels, key): the logits of `model`, but every draw adds a random
    gradient (its value is 0) of `scale` times the size of the true one."""

    def randomised(v, key):
        flat = v.reshape(v.shape[0], -1)
        noise = scale * jax.random.normal(key, (flat.shape[1], 3))
        return model(v) + (flat - jax.lax.stop_gradient(flat)) @ noise

    return randomised


def test_eot_averages_the_gradients_of_a_randomised_model():
    """A binary linear model with noisy gradients: averaged over 20 draws APGD reaches the
    analytic robust set, as on the plain model; one draw per step leaves points unbroken."""
    w, b, x, model = _binary_linear(7, 8)
    y = np.argmax(np.asarray(model(x)), -1)
    randomised = _noisy_gradients(model)

    run = jax.jit(
        lambda eot_iter: attacks.apgd(
            randomised, x, y, jax.random.PRNGKey(0), eps=4 / 255, eot_iter=eot_iter
        )[1],
        static_argnums=0,
    )
    analytic = _linear_worst_margin(w, b, x, y, 4 / 255) > 0
    np.testing.assert_array_equal(np.asarray(run(20)), analytic)
    assert np.asarray(run(1)).sum() > analytic.sum()


def _min_linf_step(points, w, shift):
    """Per row, by bisection: the smallest lam with sum_i |w_i| min(lam, room_i) >= |shift|,
    room_i the distance to the face of [0, 1] that coordinate i moves to, i.e. the smallest
    L-inf step delta in the box with w . delta = shift (inf where the box cannot reach)."""
    smallest = []
    for t, w_row, r in zip(points, w, shift):
        room = np.where(np.sign(r) * w_row > 0, 1.0 - t, t)
        reach = lambda lam: np.sum(np.abs(w_row) * np.minimum(lam, room))  # noqa: B023
        if reach(1.0) < abs(r):
            smallest.append(np.inf)
            continue
        low, high = 0.0, 1.0
        for _ in range(60):
            low, high = (
                (low, (low + high) / 2)
                if reach((low + high) / 2) >= abs(r)
                else ((low + high) / 2, high)
            )
        smallest.append(high)
    return np.array(smallest)


def _on_faces(x, seed, fraction=0.25):
    """x with a `fraction` of its pixels moved to 0 or 1, so that the box constrains steps."""
    rs = np.random.RandomState(seed)
    x = x.copy()
    faces = rs.rand(*x.shape) < fraction
    x[faces] = rs.randint(0, 2, faces.sum())
    return x


def test_fab_projection_is_the_smallest_step_in_the_box():
    rs = np.random.RandomState(0)
    points = _on_faces(rs.rand(32, 48), 1)
    w = rs.randn(32, 48)
    w[:, 40:] = 0.0
    shift = rs.randn(32) * 2
    shift[-4:] = 40.0 * np.sign(shift[-4:])  # beyond the box
    delta = np.asarray(
        fab.linf_step_to_hyperplane(*(jnp.asarray(a, jnp.float32) for a in (points, w, shift)))
    )
    smallest = _min_linf_step(points, w, shift)
    reachable = np.isfinite(smallest)
    assert reachable[:-4].all() and not reachable[-4:].any()
    np.testing.assert_allclose(np.abs(delta).max(1)[reachable], smallest[reachable], rtol=1e-4)
    np.testing.assert_allclose((w * delta).sum(1)[reachable], shift[reachable], rtol=1e-4)
    moved = points + delta
    assert moved.min() >= -1e-6 and moved.max() <= 1 + 1e-6
    assert np.all(delta[:, 40:] == 0)
    # Beyond the box: the corner nearest to the hyperplane.
    corner = np.where(np.sign(shift)[:, None] * w > 0, 1.0, 0.0)
    np.testing.assert_allclose(moved[-4:, :40], corner[-4:, :40], atol=1e-6)


def _linear_min_perturbation(w, b, x, y, target):
    """Per example the smallest L-inf perturbation within [0, 1] after which z_target >= z_y."""
    flat = x.reshape(len(x), -1).astype(np.float64)
    towards = (w[:, target] - w[:, y]).T.astype(np.float64)
    gap = (flat * towards).sum(1) + b[target] - b[y]
    return _min_linf_step(flat, towards, -gap)


def test_fab_t_ends_within_1_percent_of_the_minimal_perturbation_of_a_linear_model():
    """FAB-T towards the competing class of a binary linear model: never below the exact
    box-constrained minimum, at most 1 % above it; a quarter of the pixels sit on the box's
    faces, so the box binds (the minimum exceeds the unconstrained |gap| / ||w||_1)."""
    w, b, x, model = _binary_linear(10, 11)
    x = _on_faces(x, 12)
    y = np.argmax(np.asarray(model(x)), -1)
    target = 1 - y
    minimum = _linear_min_perturbation(w, b, x, y, target)
    flat = x.reshape(len(x), -1)
    unconstrained = ((flat @ (w[:, 0] - w[:, 1]) + b[0] - b[1]) * (1 - 2 * y)) / np.abs(
        w[:, 0] - w[:, 1]
    ).sum()
    assert np.all(np.isfinite(minimum)) and np.mean(minimum > 1.05 * unconstrained) > 0.5
    x_adv, distance = jax.jit(lambda x, y, t: fab.fab_targeted(model, x, y, t))(x, y, target)
    distance = np.asarray(distance)
    assert np.all(distance >= minimum * (1 - 1e-5)), (distance / minimum).min()
    assert np.all(distance <= minimum * 1.01), (distance / minimum).max()
    assert np.all(np.argmax(np.asarray(model(x_adv)), -1) != y)
    np.testing.assert_allclose(np.abs(np.asarray(x_adv) - x).reshape(B, -1).max(1), distance)


def test_square_breaks_a_linear_model_exactly_where_eps_allows():
    """The smallest adversarial perturbation of a linear model (over all classes, within the
    box) is known: Square can break no point above eps, and with enough queries breaks
    every point whose minimum is at most eps / 1.5; the robust ones spend every query."""
    w, b, model = _linear(12, num_classes=4)
    x = _images(13)
    y = np.argmax(np.asarray(model(x)), -1)
    minimum = np.min(
        [
            np.where(y == k, np.inf, _linear_min_perturbation(w, b, x, y, np.full(B, k)))
            for k in range(4)
        ],
        axis=0,
    )
    eps = float(np.median(minimum))
    n_queries = 3000
    x_adv, robust, queries = jax.jit(
        lambda x, y, rng: square.square(model, x, y, rng, eps=eps, n_queries=n_queries)
    )(x, y, jax.random.PRNGKey(0))
    robust, queries = np.asarray(robust), np.asarray(queries)
    assert robust[minimum > eps].all()
    clear = minimum <= eps / 1.5
    assert clear.sum() >= 16 and not robust[clear].any()
    fooled = ~robust
    assert np.all(np.argmax(np.asarray(model(x_adv)), -1)[fooled] != y[fooled])
    assert np.abs(np.asarray(x_adv) - x).max() <= eps + 1e-6
    np.testing.assert_array_equal(queries[robust], n_queries + 1)
    assert np.all(queries[fooled] <= n_queries)


def test_square_schedule_and_window():
    p = [
        square.square_fraction(i, p_init=0.8, n_queries=5000, rescale_schedule=False)
        for i in (0, 10, 11, 50, 51, 4001, 6001, 8001)
    ]
    np.testing.assert_allclose(p, 0.8 / 2.0 ** np.array([0, 0, 1, 1, 2, 7, 8, 9]))
    # Rescaled to the 10,000-query schedule: iteration 6 of 5,000 is iteration 12.
    assert square.square_fraction(6, p_init=0.8, n_queries=5000, rescale_schedule=True) == 0.4
    assert square.square_fraction(5, p_init=0.8, n_queries=5000, rescale_schedule=True) == 0.8
    sides = [int(square.window_side(p, 8, 8)) for p in (0.8, 0.1, 0.01, 0.0001)]
    assert sides == [7, 3, 1, 1]  # round(sqrt(p * 64)), capped at h - 1, at least 1


N_QUERIES = 1000


@pytest.fixture(scope="module")
def cascade_on_linear():
    """The standard cascade (one jit) on a 5-class linear model at eps 4/255, first four
    points misclassified, with honest and with masked (stop_gradient) gradients."""
    w, b, model = _linear(0)
    x = _images(1)
    y = np.argmax(np.asarray(model(x)), -1)
    y[:4] = (y[:4] + 1) % K  # clean errors
    run = jax.jit(
        lambda logits_fn: autoattack.autoattack(
            logits_fn,
            x,
            y,
            jax.random.PRNGKey(2),
            eps=4 / 255,
            n_target_classes=K - 1,
            n_queries=N_QUERIES,
        ),
        static_argnums=0,
    )
    return w, b, x, y, model, run


def _stage_flags(result):
    order = ["clean", *autoattack.VERSIONS["standard"]]
    return order, {stage: np.asarray(result.robust[stage]) for stage in order}


def test_the_cascade_reaches_the_analytic_robust_set_of_a_linear_model(cascade_on_linear):
    """APGD-CE breaks some points and APGD-T the violated pairs it missed, so the robust set
    is exact after the APGD stages; FAB-T and Square, run on what is left, break nothing
    more, and Square queries only those points, each with its whole budget."""
    w, b, x, y, model, run = cascade_on_linear
    result = run(model)
    order, flags = _stage_flags(result)
    np.testing.assert_array_equal(flags["square"], _linear_worst_margin(w, b, x, y, 4 / 255) > 0)
    assert not flags["clean"][:4].any()
    for before, after in zip(order, order[1:]):
        assert np.all(flags[after] <= flags[before]), after  # a stage only removes points
    assert (flags["clean"] & ~flags["apgd_ce"]).sum() > 0
    assert 0 < flags["square"].sum() < flags["clean"].sum()
    np.testing.assert_array_equal(flags["fab_t"], flags["apgd_t"])
    np.testing.assert_array_equal(
        np.asarray(result.square_queries), np.where(flags["fab_t"], N_QUERIES + 1, 0)
    )


def test_the_cascade_with_masked_gradients_is_each_attack_on_the_points_left(
    cascade_on_linear,
):
    """With stop_gradient the gradient attacks see a zero gradient (APGD moves only by its
    random start, FAB not at all) and Square, which only queries, breaks what they miss.
    Each stage's flags are those before it AND the same attack (same key) run alone on the
    whole batch, so the cascade's robust accuracy is at most each attack's alone; Square's
    queries go only to the points all previous attacks failed on."""
    w, b, x, y, model, run = cascade_on_linear

    def masked(v):
        return model(jax.lax.stop_gradient(v))

    result = run(masked)
    order, flags = _stage_flags(result)
    keys = autoattack.stage_keys(jax.random.PRNGKey(2), "standard")
    targets = np.asarray(attacks.autoattack_targets(model(x), K - 1))

    @jax.jit
    def alone():
        def per_target(robust, target_and_key):
            (apgd_t, fab_t), (target, key) = robust, target_and_key
            apgd_t &= attacks.apgd(
                masked, x, y, key, eps=4 / 255, loss="dlr_targeted", y_target=target
            )[1]
            fab_t &= fab.fab_targeted(masked, x, y, target)[1] > 4 / 255
            return (apgd_t, fab_t), None

        everyone = jnp.ones(len(x), bool)
        target_keys = jax.random.split(keys["apgd_t"], K - 1)
        (apgd_t, fab_t), _ = jax.lax.scan(per_target, (everyone, everyone), (targets, target_keys))
        return dict(
            apgd_ce=attacks.apgd(masked, x, y, keys["apgd_ce"], eps=4 / 255)[1],
            apgd_t=apgd_t,
            fab_t=fab_t,
            square=square.square(masked, x, y, keys["square"], eps=4 / 255, n_queries=N_QUERIES)[1],
        )

    robust_alone = {name: np.asarray(robust) for name, robust in alone().items()}
    for before, stage in zip(order, order[1:]):
        np.testing.assert_array_equal(flags[stage], flags[before] & robust_alone[stage], stage)
        assert flags["square"].mean() <= (flags["clean"] & robust_alone[stage]).mean(), stage
    np.testing.assert_array_equal(flags["fab_t"], flags["apgd_t"])  # zero gradient: FAB stays
    assert (flags["fab_t"] & ~flags["square"]).sum() >= 5
    queries = np.asarray(result.square_queries)
    assert np.all(queries[~flags["fab_t"]] == 0) and np.all(queries[flags["fab_t"]] > 0)


def test_the_rand_version_runs_apgd_ce_then_apgd_dlr_with_eot():
    """The `rand` cascade on the randomised binary linear model of the EOT test: after
    APGD-CE and APGD-DLR (20 draws each) exactly the analytic robust set is left."""
    w, b, x, model = _binary_linear(7, 8)
    y = np.argmax(np.asarray(model(x)), -1)
    randomised = _noisy_gradients(model)

    result = jax.jit(
        lambda: autoattack.autoattack(
            randomised, x, y, jax.random.PRNGKey(0), eps=4 / 255, version="rand"
        )
    )()
    assert set(result.robust) == {"clean", "apgd_ce", "apgd_dlr"} and result.square_queries is None
    analytic = _linear_worst_margin(w, b, x, y, 4 / 255) > 0
    np.testing.assert_array_equal(np.asarray(result.robust["apgd_dlr"]), analytic)


# ----- Patch-Fool ------------------------------------------------------------------------

PATCH = 4
NUM_BLOCKS = 6  # attention loss on blocks 1 .. 2; selection at the default block 4
DIM, HEADS = 16, 2


def _tiny_vit_params(seed):
    rs = np.random.RandomState(seed)

    def normal(*shape, scale=1.0):
        return (rs.randn(*shape) * scale / np.sqrt(shape[-2])).astype(np.float32)

    blocks = {name: normal(NUM_BLOCKS, DIM, DIM, scale=2.0) for name in ("q", "k", "v", "o", "mlp")}
    return {
        "embed": normal(PATCH * PATCH * 3, DIM, scale=3.0),
        "cls": normal(1, DIM),
        "pos": normal(5, DIM),
        "blocks": blocks,
        "head": normal(DIM, K, scale=3.0),
    }


def _tiny_vit(params):
    """CLS + 2x2 patches of 4x4 pixels, pre-norm attention blocks (parameter-free norm);
    returns (logits, [post-softmax attention (B, heads, 5, 5)] per block)."""

    def norm(h):
        return (h - h.mean(-1, keepdims=True)) / (h.std(-1, keepdims=True) + 1e-6)

    def block(h, blk):
        n = norm(h)
        heads = lambda m: (n @ m).reshape(h.shape[0], 5, HEADS, -1).transpose(0, 2, 1, 3)
        att = jax.nn.softmax(
            heads(blk["q"]) @ heads(blk["k"]).transpose(0, 1, 3, 2) / np.sqrt(DIM // HEADS), axis=-1
        )
        h = h + (att @ heads(blk["v"])).transpose(0, 2, 1, 3).reshape(h.shape) @ blk["o"]
        return h + jnp.tanh(norm(h) @ blk["mlp"]), att

    def apply(x):
        b = x.shape[0]
        patches = x.reshape(b, 2, PATCH, 2, PATCH, 3).transpose(0, 1, 3, 2, 4, 5).reshape(b, 4, -1)
        cls = jnp.broadcast_to(params["cls"], (b, 1, DIM))
        h = jnp.concatenate([cls, patches @ params["embed"]], axis=1) + params["pos"]
        h, maps = jax.lax.scan(block, h, params["blocks"])
        return norm(h[:, 0]) @ params["head"], list(maps)

    return apply


STD = np.array([0.1, 0.2, 0.4], np.float32)


@pytest.fixture(scope="module")
def known_maps_run():
    """Patch-Fool (2 patches, 1 CE step, lr traced) on the tiny ViT whose block-4 attention
    is replaced by maps whose answer is known: the CLS column is the largest (must be
    dropped), and the mean over heads and queries disagrees with head 0 alone and with
    query 0 alone for some images."""
    vit = _tiny_vit(_tiny_vit_params(0))
    rs = np.random.RandomState(1)
    x = _images(2, batch=16)
    maps = rs.gamma(0.3, size=(16, HEADS, 5, 5)).astype(np.float32)
    maps[..., 0] += 5.0
    maps /= maps.sum(-1, keepdims=True)
    expected = np.argsort(-maps.mean(axis=(1, 2))[:, 1:], axis=1)[:, :2]
    assert np.any(expected[:, 0] != maps[:, 0].mean(1)[:, 1:].argmax(1))
    assert np.any(expected[:, 0] != maps.mean(1)[:, 0, 1:].argmax(1))

    def with_known_maps(v):
        logits, real = vit(v)
        return logits, real[:4] + [jnp.asarray(maps)] + real[5:]

    y = np.argmax(np.asarray(vit(x)[0]), -1)
    run = jax.jit(
        lambda lr: attacks.patch_fool(
            with_known_maps,
            x,
            y,
            jax.random.PRNGKey(3),
            patch_size=PATCH,
            std=STD,
            num_patches=2,
            steps=1,
            lr=lr,
            mode="ce",
        )
    )
    return x, expected, run


def test_patch_fool_replaces_only_the_most_attended_patches(known_maps_run):
    x, expected, run = known_maps_run
    x_adv = np.asarray(run(0.22))
    inside = np.zeros((len(x), 2, 2), bool)
    for i, patches in enumerate(expected):
        inside[i, patches // 2, patches % 2] = True
    inside = np.repeat(np.repeat(inside, PATCH, 1), PATCH, 2)
    np.testing.assert_array_equal(x_adv[~inside], x[~inside])
    assert np.mean(x_adv[inside] != x[inside]) > 0.9
    assert x_adv.min() >= 0.0 and x_adv.max() <= 1.0


def test_patch_fool_steps_are_in_normalised_units(known_maps_run):
    """Adam's first step moves every coordinate by lr; the variable is delta / std, so a
    pixel moves by lr * std of its channel (the reference's lr in normalised space)."""
    x, _, run = known_maps_run
    start = np.asarray(run(0.0))
    moved = np.abs(np.asarray(run(0.01)) - start)
    changed = moved > 0
    assert changed.sum() == len(x) * 2 * PATCH * PATCH * 3  # two patches per image
    unclipped = changed & (start > 0.01) & (start < 0.99)
    per_channel = np.broadcast_to(0.01 * STD, moved.shape)
    # rtol: Adam's eps (1e-8) shortens the step a little where the gradient is tiny.
    np.testing.assert_allclose(moved[unclipped], per_channel[unclipped], rtol=1e-2)


@pytest.mark.parametrize("mode", ["attention", "ce"])
def test_patch_fool_lowers_the_true_class(mode):
    vit = _tiny_vit(_tiny_vit_params(0))
    x = _images(4, batch=32)
    logits = np.asarray(vit(x)[0])
    y = logits.argmax(-1)
    x_adv = jax.jit(
        lambda x, y, rng: attacks.patch_fool(
            vit, x, y, rng, patch_size=PATCH, std=(0.229, 0.224, 0.225), mode=mode
        )
    )(x, y, jax.random.PRNGKey(4))
    adv_logits = np.asarray(vit(x_adv)[0])
    rows = np.arange(len(y))
    assert np.mean(adv_logits.argmax(-1) == y) <= 0.5
    assert adv_logits[rows, y].mean() < logits[rows, y].mean()


def test_patch_fool_projection_divides_by_the_gradient_norm():
    g_ce = jnp.array([[2.0, 0.0]])
    conflicting = jnp.array([[-1.0, 1.0]])
    # dot = -2, ||g_ce|| = 2: subtract (-2 / 2) * g_ce (true PCGrad would give [0, 1]).
    np.testing.assert_allclose(attacks._project_conflicting(conflicting, g_ce), [[1.0, 1.0]])
    agreeing = jnp.array([[1.0, 1.0]])
    np.testing.assert_allclose(attacks._project_conflicting(agreeing, g_ce), agreeing)
