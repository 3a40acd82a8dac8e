"""The RSPC core against the paper's equations and the official code's fixtures: every case
of kind patch_occlusion (the corruption model) and rspc_loss (one training step of an RVT or
FAN classifier; tolerances: docs/testing.md, "Reference fixtures and skips")."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rspc_jax import rspc
from rspc_jax.interop import layout as torch_layout
from rspc_jax.interop import state_dicts as interop
from tests.conftest import (
    DEFAULT_RSPC_LAMBDA,
    activation_tol,
    assert_close,
    criterion_targets,
    fixture_cases,
    load_case,
    official_corruption,
    official_model,
)

LOSS_SCALE_KEY = "loss_scale_for_extra"


def _official_occlusion(case: str):
    """(corruption model, rho, its official parameters, inputs, reference outputs)."""
    case = load_case(case, "patch_occlusion")
    corruption, rho = official_corruption(case.config["constructor"], case.image_shape)
    params = interop.load_checkpoint(
        case.state_dict(),
        jax.eval_shape(corruption.init, jax.random.PRNGKey(0), case.inputs["x_nhwc"]),
    )["params"]
    return corruption, rho, params, case.inputs, case.outputs


@pytest.mark.parametrize("case", fixture_cases("patch_occlusion"))
def test_corruption_model_matches_official_fixture(case):
    corruption, rho, params, inputs, ref = _official_occlusion(case)
    lower, upper = rspc.normalized_limits(rspc.IMAGENET_MEAN, rspc.IMAGENET_STD)
    np.testing.assert_allclose(lower, ref["clamp_lower"], atol=1e-6)
    np.testing.assert_allclose(upper, ref["clamp_upper"], atol=1e-6)

    scores = corruption.apply({"params": params}, inputs["x_nhwc"])
    np.testing.assert_allclose(
        scores, ref["scores"], atol=1e-5 * max(1, np.abs(ref["scores"]).max())
    )
    np.testing.assert_array_equal(rspc.keep_mask(scores, rho), ref["patch_mask"])

    def objective(p):
        corrupted, _ = rspc.corrupt_batch(
            p,
            inputs["x_nhwc"],
            inputs["noise_nhwc"],
            corruption_model=corruption,
            rho=rho,
            ste_clip=1.0,
            grad_scale=1.0,
            lower=lower,
            upper=upper,
        )
        return jnp.sum(corrupted * inputs["G_nhwc"]), corrupted

    (value, corrupted), grads = jax.value_and_grad(objective, has_aux=True)(params)
    np.testing.assert_allclose(corrupted, ref["corrupted_nhwc"], atol=1e-6)
    np.testing.assert_allclose(value, ref["objective"], rtol=1e-5)
    for ours, key in (
        (grads["patch_embed"]["kernel"].transpose(3, 2, 0, 1), "grad/patch_embed.weight"),
        (grads["fc"]["kernel"].T, "grad/fc.weight"),
    ):
        np.testing.assert_allclose(ours, ref[key], atol=1e-4 * np.abs(ref[key]).max())


@pytest.mark.parametrize("rho", [0.05, 0.1, 0.25, 0.5, 0.9])
@pytest.mark.parametrize("grid", [4, 7, 8, 14])
def test_binarize_occludes_the_official_count(rho, grid):
    num_patches = grid * grid
    scores = jax.random.normal(jax.random.PRNGKey(grid), (6, num_patches))
    for fn in (rspc.binarize, jax.jit(rspc.binarize, static_argnums=(1, 2, 3))):
        mask = np.asarray(fn(scores, rho, 1.0, 1.0))
        assert set(np.unique(mask)) <= {0.0, 1.0}
        np.testing.assert_array_equal((mask == 0).sum(axis=1), rspc.num_occluded(num_patches, rho))
        # The occluded patches are the lowest-scoring ones.
        order = np.argsort(np.asarray(scores), axis=1)
        k = rspc.num_occluded(num_patches, rho)
        assert np.all(np.take_along_axis(mask, order[:, :k], 1) == 0)
        assert np.all(np.take_along_axis(mask, order[:, k:], 1) == 1)


def test_official_count_is_20_of_196():
    assert rspc.num_occluded(196, 0.1) == 20


@pytest.mark.parametrize("clip,scale", [(1.0, 1.0), (1.0, 65536.0), (None, 1.0), (None, 3.0)])
def test_binarize_backward_is_the_clipped_scaled_incoming_gradient(clip, scale):
    scores = jax.random.normal(jax.random.PRNGKey(0), (3, 16))
    g = 2.0 * jax.random.normal(jax.random.PRNGKey(1), (3, 16))  # some |g| > 1
    _, vjp = jax.vjp(lambda s: rspc.binarize(s, 0.1, clip, scale), scores)
    (grad,) = vjp(g)
    expected = g * scale if clip is None else np.clip(g * scale, -clip, clip)
    np.testing.assert_allclose(grad, expected, rtol=1e-6)
    (jit_grad,) = jax.jit(vjp)(g)
    np.testing.assert_allclose(jit_grad, expected, rtol=1e-6)


def test_occlusion_keeps_pixels_and_fills_whole_patches_with_clamped_noise():
    patch, grid = 4, (3, 5)
    images = jax.random.normal(jax.random.PRNGKey(0), (2, 12, 20, 3))
    noise = jax.random.uniform(jax.random.PRNGKey(1), images.shape) * 6 - 3
    mask = (jax.random.uniform(jax.random.PRNGKey(2), (2, 15)) > 0.3).astype(jnp.float32)
    pixel = rspc.patch_mask_to_pixels(mask, grid, patch)
    assert pixel.shape == (2, 12, 20, 1)
    # Constant over each patch, and equal to that patch's mask value (row-major order).
    blocks = np.asarray(pixel).reshape(2, 3, patch, 5, patch)
    np.testing.assert_array_equal(
        blocks, np.asarray(mask).reshape(2, 3, 1, 5, 1) * np.ones_like(blocks)
    )
    lower, upper = rspc.normalized_limits(rspc.IMAGENET_MEAN, rspc.IMAGENET_STD)
    out = np.asarray(rspc.occlude(images, pixel, noise, lower, upper))
    keep = np.broadcast_to(np.asarray(pixel) == 1, out.shape)
    np.testing.assert_array_equal(out[keep], np.clip(images, lower, upper)[keep])
    np.testing.assert_array_equal(out[~keep], np.clip(noise, lower, upper)[~keep])
    unclamped = np.asarray(rspc.occlude(images, pixel, noise))
    np.testing.assert_array_equal(unclamped[keep], np.asarray(images)[keep])
    np.testing.assert_array_equal(unclamped[~keep], np.asarray(noise)[~keep])


def test_alignment_loss_equals_eq2_on_sown_features():
    from rspc_jax import models

    model = models.create("vit_demo", num_classes=10, depth=3, width=32, num_heads=2)
    images = jax.random.normal(jax.random.PRNGKey(0), (4, 32, 32, 3))
    variables = model.init(jax.random.PRNGKey(1), images[:1], train=False)
    _, state = model.apply(variables, images, train=False, mutable=["intermediates"])
    features = state["intermediates"]["block_outputs"]
    assert len(features) == 3
    half = 2
    direct = np.mean(
        [
            np.mean((np.asarray(f[:half], np.float64) - np.asarray(f[half:], np.float64)) ** 2)
            for f in features
        ]
    )
    np.testing.assert_allclose(rspc.alignment_loss(features), direct, rtol=1e-5)
    # The clean side is not detached: both halves receive gradient.
    grad = jax.grad(lambda f: rspc.alignment_loss([f]))(features[0])
    assert np.abs(grad[:half]).sum() > 0 and np.abs(grad[half:]).sum() > 0


def test_bad_ratio_and_patch_size_are_rejected():
    for rho in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="ratio"):
            rspc.check_ratio(rho)
    corruption = rspc.PatchCorruptionModel(patch_size=5)
    with pytest.raises(ValueError, match="not divisible"):
        corruption.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)))


def test_random_selection_ignores_the_corruption_model():
    corruption = rspc.PatchCorruptionModel(patch_size=4)
    images = jax.random.normal(jax.random.PRNGKey(0), (3, 16, 16, 3))
    noise = jax.random.uniform(jax.random.PRNGKey(1), images.shape)
    params = corruption.init(jax.random.PRNGKey(2), images)["params"]
    random_scores = jax.random.uniform(jax.random.PRNGKey(3), (3, 16))

    def objective(p):
        corrupted, mask = rspc.corrupt_batch(
            p,
            images,
            noise,
            corruption_model=corruption,
            rho=0.25,
            ste_clip=1.0,
            grad_scale=1.0,
            lower=None,
            upper=None,
            random_scores=random_scores,
        )
        return jnp.sum(corrupted**2), mask

    grads, mask = jax.grad(objective, has_aux=True)(params)
    assert all(not np.any(g) for g in jax.tree.leaves(grads))
    np.testing.assert_array_equal(mask, rspc.keep_mask(random_scores, 0.25))


def _at(tree, path):
    for name in path:
        tree = tree[name]
    return tree


@pytest.fixture(scope="module", params=fixture_cases("rspc_loss"))
def rspc_step(request):
    """One official RSPC training forward/backward (a fixture case of kind rspc_loss), ours:
    the classifier and the occlusion model built from the case's official arguments."""
    case = load_case(request.param, "rspc_loss")
    config, inputs = case.config, case.inputs
    image_size = case.image_shape[0]
    model = official_model(config["classifier"], case.image_shape, train=True)
    targets = torch_layout.model_targets(model, image_size)
    variables = interop.init_and_load(
        model, case.state_dict(config["classifier"]), image_size=image_size
    )
    corruption, rho = official_corruption(config["occlusion_model"], case.image_shape)
    corruption_abstract = jax.eval_shape(corruption.init, jax.random.PRNGKey(0), inputs["x_nhwc"])
    corruption_targets = torch_layout.targets_from_flax(corruption_abstract)
    corruption_params = interop.load_checkpoint(
        case.state_dict(config["occlusion_model"], "occlusion_state_dict.npz"),
        corruption_abstract,
    )["params"]
    lower, upper = rspc.normalized_limits(rspc.IMAGENET_MEAN, rspc.IMAGENET_STD)
    setup = dict(
        model=model, corruption_model=corruption, rho=rho, lower=lower, upper=upper, ste_clip=1.0
    )
    data = (inputs["x_nhwc"], criterion_targets(case), inputs["noise_nhwc"])
    lam = config.get("extra_weight", DEFAULT_RSPC_LAMBDA)
    scale = config.get(LOSS_SCALE_KEY)
    with jax.default_matmul_precision("highest"):
        forward = jax.jit(functools.partial(_train_forward, **setup))(
            variables, corruption_params, data
        )
        grads = _loss_and_grads(
            variables, corruption_params, data, lam=lam, grad_scale=1.0, **setup
        )
        if scale is not None:
            grads["corruption_scaled"] = _scaled_occlusion_grads(
                corruption_params,
                data[0],
                grads["mask"],
                corruption_model=corruption,
                rho=rho,
                scale=scale,
            )
    return dict(
        config=config,
        ref=case.outputs,
        targets=targets,
        corruption_targets=corruption_targets,
        variables=variables,
        forward=forward,
        grads=grads,
        scale=scale,
    )


def _train_forward(
    variables, corruption_params, data, *, model, corruption_model, rho, lower, upper, ste_clip
):
    """The train-mode forward of rspc_loss, keeping what it does not return."""
    images, _, noise = data
    scores = corruption_model.apply({"params": corruption_params}, images)
    corrupted, keep = rspc.corrupt_batch(
        corruption_params,
        images,
        noise,
        corruption_model=corruption_model,
        rho=rho,
        ste_clip=ste_clip,
        grad_scale=1.0,
        lower=lower,
        upper=upper,
    )
    logits, state = model.apply(
        variables,
        jnp.concatenate([corrupted, images]),
        train=True,
        mutable=["intermediates", "batch_stats"],
        capture_intermediates=lambda m, _: isinstance(m, nn.BatchNorm),
    )
    return dict(
        scores=scores,
        keep=keep,
        corrupted=corrupted,
        logits=logits,
        blocks=state["intermediates"]["block_outputs"],
        bn_outputs=state["intermediates"],
    )


def _loss_and_grads(variables, corruption_params, data, *, grad_scale, **kwargs):
    """rspc_loss and its gradients; a zero `mask_probe` exposes d loss / d patch mask."""
    images, targets, noise = data
    patch = kwargs["corruption_model"].patch_size
    probe = jnp.zeros((images.shape[0], (images.shape[1] // patch) * (images.shape[2] // patch)))

    def loss(params, corruption, mask_probe):
        return rspc.rspc_loss(
            params,
            corruption,
            variables["batch_stats"],
            images,
            targets,
            noise,
            grad_scale=grad_scale,
            rngs={"dropout": jax.random.PRNGKey(0)},
            mask_probe=mask_probe,
            **kwargs,
        )

    grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    (total, aux), (params_grad, corruption_grad, mask_grad) = grad_fn(
        variables["params"], corruption_params, probe
    )
    return dict(
        total=total, aux=aux, params=params_grad, corruption=corruption_grad, mask=mask_grad
    )


def _scaled_occlusion_grads(corruption_params, images, mask_grad, *, corruption_model, rho, scale):
    """C's gradients under rspc_loss(grad_scale=S): S only enters the STE backward (the
    classifier graph does not depend on it), so chain the measured d loss / d mask through
    binarize(grad_scale=S) instead of compiling the whole step a second time."""
    _, vjp = jax.vjp(
        lambda p: rspc.binarize(corruption_model.apply({"params": p}, images), rho, 1.0, scale),
        corruption_params,
    )
    return vjp(mask_grad)[0]


def test_rspc_fixture_corruption_and_train_forward(rspc_step):
    ref, forward = rspc_step["ref"], rspc_step["forward"]
    assert_close(
        forward["scores"], ref["patch_scores"], activation_tol(ref["patch_scores"]), "patch_scores"
    )
    np.testing.assert_array_equal(forward["keep"], ref["patch_mask"])
    assert_close(forward["corrupted"].transpose(0, 3, 1, 2), ref["corrupted"], 1e-6, "corrupted")
    corrupted_logits, clean_logits = jnp.split(forward["logits"], 2)
    assert_close(corrupted_logits, ref["logits_corrupted"], 1e-4, "logits_corrupted")
    assert_close(clean_logits, ref["logits_clean"], 1e-4, "logits_clean")
    blocks = forward["blocks"]
    assert len(blocks) == len(rspc_step["config"]["block_modules"])
    for i, tokens in enumerate(blocks):
        key = f"train_block_{i:02d}"
        assert_close(tokens, ref[key], activation_tol(ref[key]), key)
        corrupted, clean = np.split(np.asarray(tokens, np.float64), 2)
        key = f"recon_loss_block_{i:02d}"
        assert_close(np.mean((corrupted - clean) ** 2), ref[key], 1e-5 * max(1, ref[key]), key)


def test_rspc_fixture_losses(rspc_step):
    ref, result = rspc_step["ref"], rspc_step["grads"]
    num_blocks = len(rspc_step["forward"]["blocks"])
    assert_close(result["aux"]["ce"], ref["loss_ce"], 1e-5 * max(1, ref["loss_ce"]), "loss_ce")
    # The official FeatureAlignmentLoss divides the sum by n_blocks + 1e-4, rspc.alignment_loss
    # by n_blocks: relative 1e-4 / (n + 1e-4) (3.3e-5 here, 3.5e-5 absolute, above the 1.06e-5
    # tolerance), so compare the official definition. In loss_total it is lam times smaller.
    official_align = result["aux"]["align"] * num_blocks / (num_blocks + 1e-4)
    assert_close(official_align, ref["loss_align"], 1e-5 * max(1, ref["loss_align"]), "loss_align")
    assert_close(result["total"], ref["loss_total"], 1e-5 * max(1, ref["loss_total"]), "loss_total")


def test_rspc_fixture_gradients(rspc_step):
    ref, result = rspc_step["ref"], rspc_step["grads"]
    for name in rspc_step["config"]["grad_params"]:
        target = rspc_step["targets"][name]
        expected = target.rule(ref[f"grad/{name}"])
        assert_close(
            _at(result["params"], target.path),
            expected,
            1e-4 * np.abs(expected).max(),
            f"grad/{name}",
        )
    for name, target in rspc_step["corruption_targets"].items():
        expected = target.rule(ref[f"occlusion_grad/{name}"])
        assert_close(
            _at(result["corruption"], target.path),
            expected,
            1e-4 * np.abs(expected).max(),
            f"occlusion_grad/{name}",
        )
    grad_mask = ref["grad_patch_mask"]
    assert_close(result["mask"], grad_mask, 1e-4 * np.abs(grad_mask).max(), "grad_patch_mask")
    assert_close(
        np.clip(result["mask"], -1, 1),
        ref["grad_scores"],
        1e-4 * np.abs(ref["grad_scores"]).max(),
        "grad_scores",
    )


def test_rspc_fixture_loss_scaled_occlusion_gradients(rspc_step):
    """grad_scale = S emulates the official unscaled C gradient under the AMP loss scaler."""
    ref, scale, result = rspc_step["ref"], rspc_step["scale"], rspc_step["grads"]
    if scale is None:
        pytest.skip(f"the case has no {LOSS_SCALE_KEY} (no *_scaled outputs)")
    for name, target in rspc_step["corruption_targets"].items():
        expected = target.rule(ref[f"occlusion_grad_scaled/{name}"])
        assert_close(
            _at(result["corruption_scaled"], target.path),
            expected,
            1e-4 * np.abs(expected).max(),
            f"occlusion_grad_scaled/{name}",
        )
    scaled = scale * np.asarray(result["mask"])
    expected = ref["grad_patch_mask_scaled"]
    assert_close(scaled, expected, 1e-4 * np.abs(expected).max(), "grad_patch_mask_scaled")
    np.testing.assert_array_equal(np.clip(scaled, -1, 1), ref["grad_scores_scaled"])


def _torch_running_var(before, flax_after, count: int, momentum: float = 0.9):
    """PyTorch's running_var after one step, from flax's: PyTorch feeds the unbiased batch
    variance (x count / (count - 1)) into the same momentum update, flax the biased one."""
    return momentum * before + (flax_after - momentum * before) * count / (count - 1)


def test_rspc_fixture_batchnorm_statistics(rspc_step):
    ref = rspc_step["ref"]
    before = rspc_step["variables"]["batch_stats"]
    after = rspc_step["grads"]["aux"]["batch_stats"]
    bn_outputs = rspc_step["forward"]["bn_outputs"]
    checked = 0
    for name, target in rspc_step["targets"].items():
        if target.collection != "batch_stats":
            continue
        ours, expected = np.asarray(_at(after, target.path)), ref[f"bn_after/{name}"]
        if target.path[-1] == "var":
            normalised = _at(bn_outputs, target.path[:-1])["__call__"][0]
            count = normalised.size // normalised.shape[-1]
            ours = _torch_running_var(np.asarray(_at(before, target.path)), ours, count)
        assert_close(ours, expected, activation_tol(expected), f"bn_after/{name}")
        checked += 1
    assert checked == sum(
        k.startswith("bn_after/") and not k.endswith("num_batches_tracked") for k in ref
    )
