"""Adversarial-training baselines and the RSPC ablation switches, against direct
computations on fixed batches."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rspc_jax import models, rspc
from rspc_jax.training import ablations, setup
from rspc_jax.training import adversarial as adv
from tests.conftest import run_python, smoke_config

MEAN, STD = (0.3, 0.3, 0.3), (0.4, 0.4, 0.4)


@pytest.fixture(scope="module")
def tiny(digits_data_dir):
    """A deterministic 1-block ViT (no dropout) with a fixed batch in normalised space."""
    config = smoke_config(digits_data_dir, **{"model.depth": 1, "model.drop_path_rate": 0.0})
    model = setup.build_model(config, 10)
    rng = np.random.default_rng(0)
    pixels = rng.uniform(0, 1, (6, 32, 32, 3)).astype(np.float32)
    images = jnp.asarray((pixels - np.asarray(MEAN)) / np.asarray(STD), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 10, 6))
    params = model.init(jax.random.PRNGKey(0), images[:1], train=False)["params"]
    return model, params, images, jax.nn.one_hot(labels, 10)


def _settings(
    method, eps=8 / 255, steps=1, step_size=0.0, beta=6.0, warmup_epochs=0, steps_per_epoch=1
):
    config = smoke_config(
        "",
        **{
            "rspc.enabled": False,
            "adversarial.method": method,
            "adversarial.eps": eps,
            "adversarial.steps": steps,
            "adversarial.step_size": step_size,
            "adversarial.beta": beta,
            "adversarial.eps_warmup_epochs": warmup_epochs,
        },
    )
    return adv.resolve(config, steps_per_epoch)


def _loss(tiny, settings, step=1000, params=None):
    """The step's adversarial loss on the fixed batch (jitted: eager attacks are slow)."""
    model, p, images, targets = tiny

    @jax.jit
    def loss(params):
        return adv.adversarial_loss(
            params,
            {},
            images,
            targets,
            jax.random.PRNGKey(3),
            jnp.arange(images.shape[0]),
            step,
            model=model,
            settings=settings,
            mean=MEAN,
            std=STD,
            rngs={"dropout": jax.random.PRNGKey(4)},
        )

    return loss(params if params is not None else p)


def _logits_of_pixels(tiny, pixels, params=None):
    model, p, _, _ = tiny
    x = (pixels - jnp.asarray(MEAN)) / jnp.asarray(STD)
    return model.apply(
        {"params": params if params is not None else p},
        x,
        train=True,
        rngs={"dropout": jax.random.PRNGKey(4)},
    )


def test_epsilon_warms_up_linearly_per_epoch():
    s = _settings("fgsm", eps=0.04, warmup_epochs=4, steps_per_epoch=10)
    eps = [float(adv.epsilon_at(step, s)) for step in (0, 9, 10, 25, 39, 40, 1000)]
    np.testing.assert_allclose(eps, [0, 0, 0.01, 0.02, 0.03, 0.04, 0.04], rtol=1e-6)
    assert float(adv.epsilon_at(0, _settings("fgsm", eps=0.04))) == pytest.approx(0.04)


@pytest.mark.parametrize("method,steps", [("fgsm", 1), ("fgsm", 2), ("pgd", 5)])
def test_perturbations_stay_in_the_ball_and_pixel_range(tiny, method, steps):
    model, params, images, targets = tiny
    settings = _settings(method, steps=steps)
    pixels = images * jnp.asarray(STD) + jnp.asarray(MEAN)
    start = adv.random_start(jax.random.PRNGKey(1), jnp.arange(6), pixels, settings.eps)

    def attack_loss(x):
        return optax.softmax_cross_entropy(_logits_of_pixels(tiny, x), targets).sum()

    x_adv = adv.signed_ascent(
        attack_loss,
        pixels,
        start,
        eps=settings.eps,
        step_size=settings.step_size,
        steps=settings.steps,
    )
    for x in (start, x_adv):
        assert float(jnp.abs(x - pixels).max()) <= settings.eps + 1e-6
        assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    assert float(jnp.abs(x_adv - start).max()) > 0


def test_more_pgd_steps_never_lower_the_training_loss(tiny):
    clean = float(
        rspc.cross_entropy(
            _logits_of_pixels(tiny, tiny[2] * jnp.asarray(STD) + jnp.asarray(MEAN)), tiny[3]
        )
    )
    losses = [
        float(_loss(tiny, _settings("pgd", steps=k, step_size=2 / 255))[0]) for k in (1, 3, 10)
    ]
    assert clean < losses[0] <= losses[1] <= losses[2], (clean, losses)


def test_trades_equals_a_direct_computation(tiny):
    settings = _settings("trades", steps=3, beta=2.0)
    _, params, images, targets = tiny
    pixels = images * jnp.asarray(STD) + jnp.asarray(MEAN)
    eps, step = settings.eps, settings.step_size
    # Direct: the thesis's start, 3 signed steps on KL(p_clean || p(x)), then the loss.
    u = rspc.uniform_noise(jax.random.PRNGKey(3), jnp.arange(6), pixels.shape[1:])
    x = jnp.clip(jnp.clip(pixels + (2 * u - 1) * eps + 1e-5, pixels - eps, pixels + eps), 0, 1)
    p_clean = jax.nn.softmax(_logits_of_pixels(tiny, pixels))

    def kl_sum(x):
        log_q = jax.nn.log_softmax(_logits_of_pixels(tiny, x))
        return jnp.sum(p_clean * (jnp.log(p_clean) - log_q))

    for _ in range(3):
        x = jnp.clip(
            jnp.clip(x + step * jnp.sign(jax.grad(kl_sum)(x)), pixels - eps, pixels + eps), 0, 1
        )

    def direct(params):
        clean = _logits_of_pixels(tiny, pixels, params)
        adv_logits = _logits_of_pixels(tiny, x, params)
        p = jax.nn.softmax(clean)
        kl = jnp.sum(p * (jax.nn.log_softmax(clean) - jax.nn.log_softmax(adv_logits)), -1)
        return jnp.mean(optax.softmax_cross_entropy(clean, targets)) + 2.0 * jnp.mean(kl)

    ours, aux = _loss(tiny, settings)
    assert float(ours) == pytest.approx(float(direct(params)), rel=1e-5)
    assert float(aux["robust_kl"]) > 0
    grads = jax.jit(jax.grad(lambda p: _loss(tiny, settings, params=p)[0]))(params)
    expected = jax.jit(jax.grad(direct))(params)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)


def test_trades_with_beta_zero_is_clean_training(tiny):
    model, params, images, targets = tiny
    settings = _settings("trades", steps=2, beta=0.0)

    def plain(params):
        return rspc.plain_loss(
            params, {}, images, targets, model=model, rngs={"dropout": jax.random.PRNGKey(4)}
        )[0]

    ours = jax.value_and_grad(lambda p: _loss(tiny, settings, params=p)[0])(params)
    expected = jax.value_and_grad(plain)(params)
    assert float(ours[0]) == pytest.approx(float(expected[0]), rel=1e-5)
    for a, b in zip(jax.tree.leaves(ours[1]), jax.tree.leaves(expected[1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_random_selection_occludes_as_many_patches_as_the_corruption_model(tiny):
    _, _, images, _ = tiny
    corruption_model = rspc.PatchCorruptionModel(8)
    corruption_params = corruption_model.init(jax.random.PRNGKey(5), images[:1])["params"]
    corrupt = functools.partial(
        rspc.corrupt_batch,
        corruption_params,
        images,
        jnp.zeros_like(images),
        corruption_model=corruption_model,
        rho=0.25,
        ste_clip=1.0,
        grad_scale=1.0,
        lower=None,
        upper=None,
    )
    _, learned = corrupt()
    _, random = corrupt(random_scores=jax.random.uniform(jax.random.PRNGKey(6), (6, 16)))
    expected = rspc.num_occluded(16, 0.25)
    np.testing.assert_array_equal((1 - learned).sum(1), [expected] * 6)
    np.testing.assert_array_equal((1 - random).sum(1), [expected] * 6)
    assert not np.array_equal(learned, random)


def test_ce_objective_sends_the_occluded_cross_entropy_to_the_corruption_model(tiny):
    model, params, images, targets = tiny
    corruption_model = rspc.PatchCorruptionModel(8)
    corruption_params = corruption_model.init(jax.random.PRNGKey(5), images[:1])["params"]
    noise = jax.random.uniform(jax.random.PRNGKey(7), images.shape)
    common = dict(
        model=model,
        corruption_model=corruption_model,
        rho=0.25,
        lam=0.7,
        ste_clip=None,
        grad_scale=1.0,
        lower=None,
        upper=None,
        rngs={"dropout": jax.random.PRNGKey(4)},
    )

    def ours(corruption_params, objective):
        return rspc.rspc_loss(
            params, corruption_params, {}, images, targets, noise, objective=objective, **common
        )[0]

    def direct(corruption_params):
        corrupted, _ = rspc.corrupt_batch(
            corruption_params,
            images,
            noise,
            corruption_model=corruption_model,
            rho=0.25,
            ste_clip=None,
            grad_scale=1.0,
            lower=None,
            upper=None,
        )
        logits = model.apply(
            {"params": params}, corrupted, train=True, rngs={"dropout": jax.random.PRNGKey(4)}
        )
        return 0.7 * rspc.cross_entropy(logits, targets)

    grad_ce = jax.grad(ours)(corruption_params, "ce")
    grad_direct = jax.grad(direct)(corruption_params)
    grad_align = jax.grad(ours)(corruption_params, "align")
    for a, b, c in zip(
        jax.tree.leaves(grad_ce), jax.tree.leaves(grad_direct), jax.tree.leaves(grad_align)
    ):
        assert float(jnp.abs(b).max()) > 0
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-8)
        assert not np.allclose(a, c)


def _patch_vit(pool):
    """A ViT whose tokens are disjoint 8x8 patches (patch stem), so a patch's pixels reach
    only its own token."""
    model = models.create(
        "vit_tiny", num_classes=10, width=32, depth=2, num_heads=2, patch_size=8, pool=pool
    )
    images = jax.random.normal(jax.random.PRNGKey(0), (2, 32, 32, 3))
    return model, model.init(jax.random.PRNGKey(1), images, train=False), images


@pytest.mark.parametrize("pool", ["avg", "token"])
def test_dropped_tokens_leave_no_trace_in_the_kept_ones(pool):
    model, variables, images = _patch_vit(pool)
    keep = np.ones((2, 16), np.float32)
    keep[:, [0, 5, 9]] = 0.0  # patches (0, 0), (1, 1), (2, 1) of the 4x4 grid

    def run(x, token_keep):
        logits, state = model.apply(
            variables, x, train=False, token_keep=token_keep, mutable=["intermediates"]
        )
        return logits, state["intermediates"]["block_outputs"]

    logits, blocks = run(images, keep)
    other = jax.random.normal(jax.random.PRNGKey(2), images.shape)
    changed = images
    for row, col in ((0, 0), (1, 1), (2, 1)):
        window = (slice(None), slice(8 * row, 8 * row + 8), slice(8 * col, 8 * col + 8))
        changed = changed.at[window].set(other[window])
    changed_logits, changed_blocks = run(changed, keep)
    np.testing.assert_allclose(changed_logits, logits, atol=1e-5)
    prefix = 1 if pool == "token" else 0
    kept = prefix + np.flatnonzero(keep[0])
    for ours, ref in zip(changed_blocks, blocks):
        np.testing.assert_allclose(ours[:, kept], ref[:, kept], atol=1e-5)
    # Keeping everything is the model itself; a kept patch does reach the output.
    np.testing.assert_allclose(
        run(images, np.ones_like(keep))[0], model.apply(variables, images, train=False), atol=1e-6
    )
    assert not np.allclose(run(images.at[:, :8, 8:16].set(0.0), keep)[0], logits, atol=1e-4)


def test_token_dropping_aligns_kept_tokens_and_trains_the_corruption_model():
    model, variables, images = _patch_vit("token")
    corruption_model = rspc.PatchCorruptionModel(8)
    corruption_params = corruption_model.init(jax.random.PRNGKey(5), images[:1])["params"]
    targets = jax.nn.one_hot(jnp.arange(2), 10)
    common = dict(
        model=model,
        corruption_model=corruption_model,
        rho=0.25,
        lam=1.0,
        ste_clip=None,
        grad_scale=1.0,
        lower=None,
        upper=None,
        rngs={},
        drop_tokens=True,
    )

    def loss(corruption_params):
        return rspc.rspc_loss(
            variables["params"],
            corruption_params,
            {},
            images,
            targets,
            jnp.zeros_like(images),
            **common,
        )

    (total, aux), grads = jax.value_and_grad(loss, has_aux=True)(corruption_params)
    keep = np.asarray(aux["keep"])
    assert (1 - keep).sum(1).tolist() == [rspc.num_occluded(16, 0.25)] * 2
    # L_align by hand: the dropped forward against the clean one, over the kept tokens.
    _, dropped = model.apply(
        variables, images, train=True, token_keep=keep, mutable=["intermediates"]
    )
    _, clean = model.apply(variables, images, train=True, mutable=["intermediates"])
    kept = np.concatenate([[True], keep[0] > 0]), np.concatenate([[True], keep[1] > 0])
    by_hand = np.mean(
        [
            np.mean(
                np.concatenate(
                    [np.square(np.asarray(d[b] - c[b]))[kept[b]].ravel() for b in range(2)]
                )
            )
            for d, c in zip(
                dropped["intermediates"]["block_outputs"], clean["intermediates"]["block_outputs"]
            )
        ]
    )
    np.testing.assert_allclose(aux["align"], by_hand, rtol=1e-5)
    assert float(aux["align"]) > 0
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads)) > 0


def test_token_dropping_is_refused_for_grid_models():
    config = smoke_config("", model_name="rvt_tiny", **{"rspc.fill": "drop"})
    config.model = dict(base_dims=(8, 8), depth=(1, 1), heads=(2, 4))
    model = setup.build_model(config, 10)
    with pytest.raises(ValueError, match="cannot do .RVT, FAN and XCiT"):
        setup.check_model_fits(config, model)


_ABLATION_SCRIPT = """
import sys, importlib.util
import jax, numpy as np
from rspc_jax import parallel
from rspc_jax.data import specs as datasets
from rspc_jax.training import ablations, setup
spec = importlib.util.spec_from_file_location("demo_config", "configs/demo.py")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
rng = np.random.default_rng(0)
batch = {"image": rng.standard_normal((8, 32, 32, 3)).astype(np.float32),
         "label": rng.integers(0, 10, 8).astype(np.int32)}
mesh = parallel.create_mesh()
for name in ablations.ABLATIONS:
    config = module.get_config(name)
    config.update(dict(data_dir=sys.argv[1], batch_size=8))
    config.model.update(dict(depth=1, width=16, num_heads=1))
    setup.validate_config(config)
    data = datasets.dataset_spec(config.dataset)
    model = setup.build_model(config, data.num_classes)
    parts = setup.build(config, model, data, mesh, steps_per_epoch=10, total_steps=20)
    state = parts.init(jax.random.PRNGKey(0))
    for _ in range(2):
        state, metrics = parts.train_step(state, parallel.to_global(batch, mesh))
    print(name, int(state.step), float(metrics["loss"]), flush=True)
"""


def test_every_ablation_config_takes_finite_steps(digits_data_dir):
    """configs/demo.py:<name> at a 1-block width-16 ViT: two train steps each."""
    result = run_python(["-c", _ABLATION_SCRIPT, digits_data_dir], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines() if line.strip()]
    assert [row[0] for row in rows] == list(ablations.ABLATIONS)
    for name, step, loss in rows:
        assert step == "2" and np.isfinite(float(loss)), (name, step, loss)


def test_adversarial_training_with_rspc_or_a_bad_eps_is_refused():
    with pytest.raises(ValueError, match="set config.rspc.enabled=False"):
        setup.validate_config(smoke_config("", **{"adversarial.method": "fgsm"}))
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        setup.validate_config(
            smoke_config(
                "", **{"adversarial.method": "pgd", "rspc.enabled": False, "adversarial.eps": 8.0}
            )
        )
