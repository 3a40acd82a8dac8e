"""The RSPC core against the paper's equations and the official code's fixture."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rspc_jax import rspc
from rspc_jax.interop import state_dicts as interop
from tests.conftest import fixture_dir


def _official_occlusion():
    path = fixture_dir("rspc_occlusion")
    inputs = np.load(path / "inputs.npz")
    params = interop.load_checkpoint(
        str(path / "state_dict.npz"),
        jax.eval_shape(rspc.PatchCorruptionModel(16).init, jax.random.PRNGKey(0), inputs["x_nhwc"]),
    )["params"]
    return params, inputs, np.load(path / "outputs.npz")


def test_corruption_model_matches_official_fixture():
    params, inputs, ref = _official_occlusion()
    corruption = rspc.PatchCorruptionModel(patch_size=16)
    lower, upper = rspc.normalized_limits(rspc.IMAGENET_MEAN, rspc.IMAGENET_STD)
    np.testing.assert_allclose(lower, ref["clamp_lower"], atol=1e-6)
    np.testing.assert_allclose(upper, ref["clamp_upper"], atol=1e-6)

    scores = corruption.apply({"params": params}, inputs["x_nhwc"])
    np.testing.assert_allclose(
        scores, ref["scores"], atol=1e-5 * max(1, np.abs(ref["scores"]).max())
    )
    np.testing.assert_array_equal(rspc.keep_mask(scores, 0.1), ref["patch_mask"])

    def objective(p):
        corrupted, _ = rspc.corrupt_batch(
            p,
            inputs["x_nhwc"],
            inputs["noise_nhwc"],
            corruption_model=corruption,
            rho=0.1,
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
