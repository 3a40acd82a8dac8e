"""RVT*'s patch-wise augmentation: patch layout, the crop resampling, probabilities, clamp."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rspc_jax.training import patch_aug


def test_patches_follow_token_order_and_fold_back_exactly():
    images = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 12, 3))
    patches = patch_aug.to_patches(images, 4)
    assert patches.shape == (2 * 2 * 3, 4, 4, 3)
    # Token 4 of image 1 = grid row 1, column 1.
    np.testing.assert_array_equal(patches[6 + 4], images[1, 4:8, 4:8])
    np.testing.assert_array_equal(patch_aug.from_patches(patches, images.shape), images)


def test_full_area_crop_is_the_identity(monkeypatch):
    monkeypatch.setattr(patch_aug, "CROP_SCALE", (1.0, 1.0))
    patches = jax.random.normal(jax.random.PRNGKey(1), (5, 16, 16, 3))
    np.testing.assert_allclose(
        patch_aug.random_resized_crop(jax.random.PRNGKey(2), patches), patches, atol=1e-6
    )


def test_crop_resamples_a_linear_ramp_bilinearly(monkeypatch):
    """On f(y, x) = x the bilinear resize of the crop [o, o + s] is exactly
    o + (j + 0.5) * s / p - 0.5 at output column j."""
    monkeypatch.setattr(patch_aug, "CROP_SCALE", (0.25, 0.25))  # side = p / 2
    size = 16
    ramp = jnp.broadcast_to(jnp.arange(size, dtype=jnp.float32)[None, :, None], (size, size, 1))
    out = patch_aug.random_resized_crop(jax.random.PRNGKey(3), ramp[None].repeat(64, 0))
    offsets = out[:, 0, 1, 0] - (1.5 * 0.5 - 0.5)  # recovered per patch
    expected = offsets[:, None] + (np.arange(size) + 0.5) * 0.5 - 0.5
    # The outermost samples lie 0.25 px outside the crop: clamped to the patch edge.
    np.testing.assert_allclose(out[:, 3, :, 0], np.clip(expected, 0, size - 1), atol=1e-5)
    assert float(offsets.min()) >= 0.0 and float(offsets.max()) <= size / 2
    assert float(offsets.std()) > 1.0  # offsets are random


def test_each_operation_hits_about_a_tenth_of_the_patches_and_the_clamp_holds():
    images = jax.random.uniform(jax.random.PRNGKey(4), (16, 64, 64, 3), minval=-1.0, maxval=1.0)
    lower, upper = jnp.array([-0.9] * 3), jnp.array([0.9] * 3)
    out = patch_aug.patch_augment(jax.random.PRNGKey(5), images, 4, lower, upper)
    changed = np.any(
        patch_aug.to_patches(out, 4) != patch_aug.to_patches(jnp.clip(images, lower, upper), 4),
        axis=(1, 2, 3),
    )
    # P(at least one of three independent p = 0.1 operations) = 0.271.
    assert changed.mean() == pytest.approx(1 - 0.9**3, abs=0.02)
    assert float(out.min()) >= -0.9 and float(out.max()) <= 0.9
    same_key = patch_aug.patch_augment(jax.random.PRNGKey(5), images, 4, lower, upper)
    np.testing.assert_array_equal(out, same_key)
