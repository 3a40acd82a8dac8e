"""timm RandAugment / RandomErasing (host draws, accelerator noise) against numpy ports of
PIL and timm."""

import math

import numpy as np
import pytest
import tensorflow as tf

from rspc_jax.data import augment, on_device, options
from tests.conftest import random_erasing_before

INCREASING = (
    "AutoContrast",
    "Equalize",
    "Invert",
    "Rotate",
    "PosterizeIncreasing",
    "SolarizeIncreasing",
    "SolarizeAdd",
    "ColorIncreasing",
    "ContrastIncreasing",
    "BrightnessIncreasing",
    "SharpnessIncreasing",
    "ShearX",
    "ShearY",
    "TranslateXRel",
    "TranslateYRel",
)


def random_image(seed=0, size=(32, 32), low=0, high=256):
    rng = np.random.default_rng(seed)
    return rng.integers(low, high, (*size, 3)).astype(np.uint8)


def run(name, image, magnitude, negate=False):
    out = augment.apply_op(tf.constant(image, tf.float32), name, magnitude, negate)
    return out.numpy()


def key(i):
    return tf.constant([i, 7], tf.int64)


# --- numpy ports of PIL (Pillow's ImageOps / ImageEnhance / Geometry.c) ---


def pil_grey(image):
    rgb = image.astype(np.int64)
    return ((rgb[..., 0] * 19595 + rgb[..., 1] * 38470 + rgb[..., 2] * 7471 + 0x8000) >> 16)[
        ..., None
    ]


def pil_blend(degenerate, image, factor):
    """(UINT8)(in1 + alpha * (in2 - in1)) in C float, clipped if extrapolating."""
    degenerate = np.broadcast_to(degenerate, image.shape).astype(np.float32)
    mixed = degenerate + np.float32(factor) * (image.astype(np.float32) - degenerate)
    return np.clip(np.floor(mixed), 0, 255)


def pil_equalize(image):
    out = np.empty_like(image)
    for c in range(3):
        h = np.bincount(image[..., c].ravel(), minlength=256).tolist()
        histo = [v for v in h if v]
        lut = list(range(256))
        if len(histo) > 1:
            step = (sum(histo) - histo[-1]) // 255
            if step:
                lut, n = [], step // 2
                for i in range(256):
                    lut.append(n // step)
                    n = n + h[i]
        out[..., c] = np.clip(np.array(lut), 0, 255)[image[..., c]]
    return out


def pil_autocontrast(image):
    out = np.empty_like(image)
    for c in range(3):
        lo, hi = int(image[..., c].min()), int(image[..., c].max())
        lut = list(range(256))
        if hi > lo:
            scale = 255.0 / (hi - lo)
            offset = -lo * scale
            lut = [min(max(int(i * scale + offset), 0), 255) for i in range(256)]
        out[..., c] = np.array(lut)[image[..., c]]
    return out


def pil_smooth(image):
    """ImageFilter.SMOOTH: (8 neighbours + 5 x centre) / 13, rounded; no border."""
    x = image.astype(np.float64)
    out = x.copy()
    total = (
        sum(
            x[1 + dy : x.shape[0] - 1 + dy, 1 + dx : x.shape[1] - 1 + dx]
            for dy in (-1, 0, 1)
            for dx in (-1, 0, 1)
        )
        + 4 * x[1:-1, 1:-1]
    )
    out[1:-1, 1:-1] = np.floor(total / 13 + 0.5)
    return out


def pil_affine(image, matrix):
    """Image.transform(AFFINE, matrix, BILINEAR, fillcolor=FILL) (Geometry.c)."""
    h, w, _ = image.shape
    a, b, c, d, e, f = matrix
    ys, xs = np.mgrid[0:h, 0:w] + 0.5
    x_in, y_in = a * xs + b * ys + c, d * xs + e * ys + f
    inside = (x_in >= 0) & (x_in < w) & (y_in >= 0) & (y_in < h)
    x, y = x_in - 0.5, y_in - 0.5
    x0, y0 = np.floor(x).astype(int), np.floor(y).astype(int)
    dx, dy = (x - x0)[..., None], (y - y0)[..., None]
    cx0, cx1 = np.clip(x0, 0, w - 1), np.clip(x0 + 1, 0, w - 1)
    cy0, cy1 = np.clip(y0, 0, h - 1), np.clip(y0 + 1, 0, h - 1)
    px = image.astype(np.float64)
    top = px[cy0, cx0] + (px[cy0, cx1] - px[cy0, cx0]) * dx
    bottom = px[cy1, cx0] + (px[cy1, cx1] - px[cy1, cx0]) * dx
    value = np.trunc(top + (bottom - top) * dy)
    return np.where(inside[..., None], value, np.array(augment.FILL, float))


def pil_rotate_matrix(degrees, w, h):
    """Image.rotate's affine matrix (expand=False, centre (w/2, h/2))."""
    angle = -math.radians(degrees)
    m = [
        round(math.cos(angle), 15),
        round(math.sin(angle), 15),
        0.0,
        round(-math.sin(angle), 15),
        round(math.cos(angle), 15),
        0.0,
    ]
    cx, cy = w / 2.0, h / 2.0
    m[2] = m[0] * -cx + m[1] * -cy + cx
    m[5] = m[3] * -cx + m[4] * -cy + cy
    return m


# --- spec parsing ---


def test_parse_official_spec():
    spec = options.parse_rand_augment("rand-m9-mstd0.5-inc1")
    assert (
        spec.magnitude,
        spec.num_layers,
        spec.magnitude_std,
        spec.magnitude_max,
        spec.increasing,
        spec.prob,
    ) == (9, 2, 0.5, 10, True, 0.5)
    assert spec.ops == INCREASING


def test_parse_other_sections_and_defaults():
    spec = options.parse_rand_augment("rand-n3-p0.7-m5-mmax20")
    assert (
        spec.magnitude,
        spec.num_layers,
        spec.prob,
        spec.magnitude_max,
        spec.increasing,
        spec.magnitude_std,
    ) == (5, 3, 0.7, 20, False, 0.0)
    assert "Posterize" in spec.ops and "PosterizeIncreasing" not in spec.ops
    assert len(spec.ops) == 15
    assert options.parse_rand_augment("rand") == options.RandAugmentSpec()
    assert options.parse_rand_augment("rand-mstd101").magnitude_std == math.inf


@pytest.mark.parametrize(
    "spec",
    [
        "augmix-m3",
        "rand-m9-w0",
        "rand-x1",
        "rand-mfoo",
        "rand-m",
        "rand-n0",
        "rand-p1.5",
        "rand-m9.5",
        "",
    ],
)
def test_parse_rejects_bad_specs(spec):
    with pytest.raises(ValueError, match="RandAugment spec"):
        options.parse_rand_augment(spec)


# --- pixel ops against PIL at fixed magnitudes ---


def test_invert_posterize_solarize():
    image = random_image()
    x = image.astype(np.float32)
    np.testing.assert_array_equal(run("Invert", image, 9), 255 - x)
    # PosterizeIncreasing keeps 4 - int(4 m / 10) bits: m=9, 5, 10 -> 1, 2, 0.
    np.testing.assert_array_equal(run("PosterizeIncreasing", image, 9), image & 0x80)
    np.testing.assert_array_equal(run("PosterizeIncreasing", image, 5), image & 0xC0)
    assert not run("PosterizeIncreasing", image, 10).any()
    np.testing.assert_array_equal(run("Posterize", image, 9), image & 0xE0)
    # SolarizeIncreasing threshold 256 - int(256 * 0.9) = 26; Solarize 230.
    np.testing.assert_array_equal(run("SolarizeIncreasing", image, 9), np.where(x < 26, x, 255 - x))
    np.testing.assert_array_equal(run("Solarize", image, 9), np.where(x < 230, x, 255 - x))
    # SolarizeAdd adds int(110 * 0.9) = 99 below 128, saturating.
    np.testing.assert_array_equal(
        run("SolarizeAdd", image, 9), np.where(x < 128, np.minimum(x + 99, 255), x)
    )


def test_equalize_matches_pil():
    image = random_image(1)
    image[..., 1] = (image[..., 1].astype(int) ** 2 // 255).astype(np.uint8)
    image[..., 2] = 200
    image[:3, :, 2] = 0  # 96 other pixels: step 0, left unchanged by PIL
    out = run("Equalize", image, 9)
    np.testing.assert_array_equal(out, pil_equalize(image))
    np.testing.assert_array_equal(out[..., 2], image[..., 2])
    assert not np.array_equal(out[..., 1], image[..., 1])


def test_auto_contrast_stretches_each_channel():
    image = random_image(2, low=40, high=201)
    image[..., 2] = 90  # a constant channel stays as it is
    out = run("AutoContrast", image, 9)
    np.testing.assert_array_equal(out, pil_autocontrast(image))
    assert out[..., :2].min() == 0 and out[..., :2].max() == 255
    np.testing.assert_array_equal(out[..., 2], 90)


@pytest.mark.parametrize("negate", [False, True])
def test_enhance_ops_blend_like_pil(negate):
    image = random_image(3)
    # timm's *Increasing factor at m=9: 1 +- 0.9 m / 10, in Python floats.
    level = 9 / 10.0 * 0.9
    factor = 1.0 + (-level if negate else level)
    grey = pil_grey(image)
    mean = int(grey.mean() + 0.5)
    expected = {
        "BrightnessIncreasing": pil_blend(np.zeros(1), image, factor),
        "ColorIncreasing": pil_blend(grey, image, factor),
        "ContrastIncreasing": pil_blend(np.full(1, mean), image, factor),
        "SharpnessIncreasing": pil_blend(pil_smooth(image), image, factor),
    }
    for name, reference in expected.items():
        out = run(name, image, 9, negate)
        np.testing.assert_array_equal(out, reference, err_msg=name)
    # The non-increasing enhancements use 0.1 + 1.8 m / 10 whatever the sign.
    np.testing.assert_array_equal(
        run("Brightness", image, 5, negate), pil_blend(np.zeros(1), image, 1.0)
    )


def test_sharpness_leaves_the_border_alone():
    image = random_image(4)
    out = run("SharpnessIncreasing", image, 10)
    np.testing.assert_array_equal(out[[0, -1]], image[[0, -1]])
    np.testing.assert_array_equal(out[:, [0, -1]], image[:, [0, -1]])
    assert not np.array_equal(out[1:-1, 1:-1], image[1:-1, 1:-1])


# --- geometric ops ---


def test_rotate_90_moves_a_marked_pixel_counter_clockwise():
    image = np.zeros((32, 32, 3), np.uint8)
    image[25, 15] = 255  # below the centre (16, 16) in pixel-centre coordinates
    # Rotate is 30 degrees x m / 10, so m=30 is 90 degrees.
    out = run("Rotate", image, 30)
    assert out[16, 25].tolist() == [255, 255, 255]  # now right of the centre
    assert (out[..., 0] == 255).sum() == 1
    clockwise = run("Rotate", image, 30, negate=True)
    assert clockwise[15, 6].tolist() == [255, 255, 255]  # left of the centre
    # The corners rotate out of the image and take timm's mean colour.
    np.testing.assert_array_equal(run("Rotate", image, 15)[0, 0], augment.FILL)


@pytest.mark.parametrize("negate", [False, True])
def test_translate_shifts_by_45_percent_of_m_and_fills(negate):
    image = random_image(5, size=(40, 40))
    fill_x = np.broadcast_to(np.array(augment.FILL, np.float32), (40, 9, 3))
    fill_y = fill_x.transpose(1, 0, 2)
    # 0.45 x m / 10 of the size: m=5 on 40 px is 9 px.
    out_x = run("TranslateXRel", image, 5, negate)
    out_y = run("TranslateYRel", image, 5, negate)
    if not negate:  # samples 9 px to the right / below: content moves left / up
        np.testing.assert_array_equal(out_x[:, :31], image[:, 9:])
        np.testing.assert_array_equal(out_x[:, 31:], fill_x)
        np.testing.assert_array_equal(out_y[:31], image[9:])
        np.testing.assert_array_equal(out_y[31:], fill_y)
    else:
        np.testing.assert_array_equal(out_x[:, 9:], image[:, :31])
        np.testing.assert_array_equal(out_x[:, :9], fill_x)
        np.testing.assert_array_equal(out_y[9:], image[:31])
        np.testing.assert_array_equal(out_y[:9], fill_y)


@pytest.mark.parametrize("negate", [False, True])
def test_geometric_ops_match_pil_bilinear(negate):
    image = random_image(6)
    sign = -1.0 if negate else 1.0
    matrices = {
        "Rotate": pil_rotate_matrix(sign * 27.0, 32, 32),
        "ShearX": (1, sign * 0.27, 0, 0, 1, 0),
        "ShearY": (1, 0, 0, sign * 0.27, 1, 0),
        "TranslateXRel": (1, 0, sign * 0.405 * 32, 0, 1, 0),
        "TranslateYRel": (1, 0, 0, 0, 1, sign * 0.405 * 32),
    }
    for name, matrix in matrices.items():
        out = run(name, image, 9, negate)
        reference = pil_affine(image, matrix)
        diff = np.abs(out - reference)
        # Truncation to uint8 differs by 1 where float32 (TF) or float64 (PIL)
        # rounding puts a value just below an integer.
        assert (diff > 1).mean() < 0.002, name
        assert (diff > 0).mean() < 0.02, name


def _inside_before(image_shape, matrix):
    """_affine's in-bounds mask as it was computed before (on a meshgrid): the oracle below."""
    a, b, c, d, e, f = (tf.constant(v, tf.float64) for v in matrix)
    height, width = (tf.constant(float(n), tf.float64) for n in image_shape[:2])
    ys, xs = tf.meshgrid(tf.range(height) + 0.5, tf.range(width) + 0.5, indexing="ij")
    x_in, y_in = a * xs + b * ys + c, d * xs + e * ys + f
    return ((x_in >= 0) & (x_in < width) & (y_in >= 0) & (y_in < height)).numpy()


@pytest.mark.parametrize("size", [(224, 224), (37, 53)])
def test_affine_fill_region_bitwise_as_before(size):
    """The affine ops fill exactly the pixels they filled when the in-bounds test ran on a
    meshgrid: a constant image shows the fill region, over rotations, shears and
    translations that put the boundary on pixel centres."""
    image = np.full((*size, 3), 7.0, np.float32)
    h, w = size
    matrices = [pil_rotate_matrix(deg, w, h) for deg in (-30.0, -12.5, 0.0, 17.0, 27.0, 90.0)]
    matrices += [(1, s, 0, 0, 1, 0) for s in (-0.3, -0.27, 0.125, 0.3)]
    matrices += [(1, 0, 0, s, 1, 0) for s in (-0.3, 0.25)]
    matrices += [(1, 0, t * w, 0, 1, 0) for t in (-0.45, -0.25, 0.4)]
    matrices += [(1, 0, 0, 0, 1, t * h) for t in (-0.405, 0.5)]
    for matrix in matrices:
        out = augment._affine(tf.constant(image), tuple(float(v) for v in matrix)).numpy()
        filled = (out != 7.0).all(-1)
        np.testing.assert_array_equal(filled, ~_inside_before(size, matrix), err_msg=str(matrix))


# --- RandAugment as a whole ---


def test_rand_augment_is_a_pure_function_of_the_key():
    image = tf.constant(random_image(7), tf.float32)
    spec = "rand-m9-mstd0.5-inc1"
    a = augment.rand_augment(image, key(1), spec).numpy()
    b = augment.rand_augment(image, key(1), spec).numpy()
    graph = tf.function(augment.rand_augment, autograph=False)
    c = graph(image, key(1), options.parse_rand_augment(spec)).numpy()
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)
    outputs = {augment.rand_augment(image, key(i), spec).numpy().tobytes() for i in range(12)}
    assert len(outputs) >= 8
    assert a.dtype == np.float32 and a.min() >= 0 and a.max() <= 255
    np.testing.assert_array_equal(a, np.round(a))


def test_rand_augment_draws_every_increasing_op_at_timm_levels():
    image = random_image(8)
    candidates = {}
    for name in INCREASING:
        for negate in (False, True):
            candidates.setdefault(run(name, image, 10, negate).tobytes(), set()).add(name)
    image = tf.constant(image, tf.float32)
    seen = set()
    for i in range(150):
        out = augment.rand_augment(image, key(i), "rand-n1-m10-inc1-p1.0")
        names = candidates.get(out.numpy().tobytes())
        assert names, f"key {i}: output is no single op at m=10"
        seen |= names
    assert seen == set(INCREASING)
    # p 0.5: each op is skipped half of the time.
    unchanged = sum(
        np.array_equal(augment.rand_augment(image, key(i), "rand-n1-m10-inc1"), image)
        for i in range(100)
    )
    assert 35 <= unchanged <= 65


def test_magnitude_is_normal_around_m_and_clipped():
    spec = options.parse_rand_augment("rand-m9-mstd0.5")
    draws = np.array([float(augment._sample_magnitude(spec, key(i))) for i in range(400)])
    assert abs(draws.mean() - 9) < 0.08 and abs(draws.std() - 0.5) < 0.08
    assert draws.max() <= 10
    spec = options.parse_rand_augment("rand-m10-mstd1")
    draws = np.array([float(augment._sample_magnitude(spec, key(i))) for i in range(200)])
    assert draws.max() == 10 and 0.35 < (draws == 10).mean() < 0.65
    spec = options.parse_rand_augment("rand-m6-mstd200")  # uniform in [0, 6]
    draws = np.array([float(augment._sample_magnitude(spec, key(i))) for i in range(200)])
    assert draws.min() >= 0 and draws.max() <= 6 and abs(draws.mean() - 3) < 0.4


# --- random erasing ---


def erased_box(before, after):
    """(top, left, h, w) of the changed pixels; asserts they form one box."""
    changed = (before != after).any(axis=-1)
    rows, cols = np.nonzero(changed)
    top, left = rows.min(), cols.min()
    h, w = rows.max() - top + 1, cols.max() - left + 1
    # N(0, 1) noise equals the old value with probability 0: the box is full.
    assert changed.sum() == h * w
    assert (before[changed] != after[changed]).all()
    return top, left, h, w


def erase(image, i, prob):
    """The image erased as training erases it: the host's box draws (key(i)), the
    accelerator's noise (`on_device.erase`); also returns the box."""
    box, noise_key = augment.erasing_box(image.shape, key(i), prob)
    out = on_device.erase(image[None], box.numpy()[None], noise_key.numpy()[None])[0]
    return np.asarray(out), box.numpy()


def test_random_erasing_prob_one_erases_one_box():
    image = np.random.default_rng(9).normal(size=(32, 32, 3)).astype(np.float32)
    fractions, aspects, noise = [], [], []
    for i in range(60):
        out, box = erase(image, i, 1.0)
        top, left, h, w = erased_box(image, out)
        assert (top, left, h, w) == tuple(box)
        assert h < 32 and w < 32
        fractions.append(h * w / 1024)
        aspects.append(h / w)
        noise.append(out[top : top + h, left : left + w].ravel())
    # Area fraction in [0.02, 1/3], aspect in [0.3, 1/0.3], up to rounding h, w.
    assert 0.015 <= min(fractions) and max(fractions) <= 0.36
    assert max(fractions) > 0.2 and min(fractions) < 0.1
    assert 0.2 <= min(aspects) and max(aspects) <= 5
    noise = np.concatenate(noise)
    assert abs(noise.mean()) < 0.05 and abs(noise.std() - 1) < 0.05


def test_random_erasing_probability():
    image = np.random.default_rng(10).normal(size=(16, 16, 3)).astype(np.float32)
    for i in range(20):
        out, box = erase(image, i, 0.0)
        np.testing.assert_array_equal(out, image)
        assert box[2] == box[3] == 0
    erased = sum(not np.array_equal(erase(image, i, 0.25)[0], image) for i in range(200))
    assert 30 <= erased <= 70
    np.testing.assert_array_equal(erase(image, 3, 0.25)[0], erase(image, 3, 0.25)[0])


@pytest.mark.parametrize("size", [(224, 224), (37, 53), (2, 2)])
def test_random_erasing_erases_the_box_the_host_erased_before(size):
    """The host's draws give the box that the host-side erasing (`random_erasing_before`,
    the same keys) filled, eagerly and traced as tf.data traces them, on the recipe's size,
    an odd size and one where no box fits; the accelerator leaves every pixel outside it
    bitwise as it was."""
    image = np.random.default_rng(11).normal(size=(*size, 3)).astype(np.float32)
    traced = tf.function(lambda k, p: augment.erasing_box(image.shape, k, p))
    erased = 0
    for i in range(40):
        for prob in (0.25, 1.0):
            before = random_erasing_before(tf.constant(image), key(i), prob).numpy()
            out, box = erase(image, i, prob)
            np.testing.assert_array_equal(traced(key(i), tf.constant(prob))[0], box)
            if np.array_equal(before, image):
                assert box[2] * box[3] == 0  # not erased (an empty box may be drawn, as timm)
                np.testing.assert_array_equal(out, image)
                continue
            erased += 1
            assert tuple(box) == erased_box(image, before)
            inside = np.zeros(size, bool)
            inside[box[0] : box[0] + box[2], box[1] : box[1] + box[3]] = True
            np.testing.assert_array_equal(out[~inside], image[~inside])
            assert (out[inside] != image[inside]).all()
    assert erased > 0 or size == (2, 2)


# --- config wiring ---


def test_config_defaults_recipe_and_validation():
    from rspc_jax.training import defaults as config_defaults
    from rspc_jax.training import recipes, setup

    config = config_defaults.get_default_config()
    assert (
        config.rand_augment,
        config.random_erase_prob,
        config.repeated_augment,
        config.eval_preprocess,
    ) == ("", 0.0, 1, "")
    recipes.apply_imagenet_recipe(config, batch_size=1024, per_device_batch=128)
    assert (config.rand_augment, config.random_erase_prob, config.repeated_augment) == (
        "rand-m9-mstd0.5-inc1",
        0.25,
        3,
    )
    setup.validate_config(config)
    for field, value, message in [
        ("random_erase_prob", 1.5, "random_erase_prob=1.5"),
        ("repeated_augment", 0, "repeated_augment=0"),
        ("rand_augment", "rand-m9-x2", "rand-m9-x2"),
        ("eval_preprocess", "resize", "'center_crop'"),
    ]:
        bad = config_defaults.get_default_config()
        bad[field] = value
        with pytest.raises(ValueError, match=message):
            setup.validate_config(bad)


def test_color_jitter_is_keyed_bounded_and_the_identity_at_strength_zero():
    image = tf.constant(np.random.default_rng(0).integers(0, 256, (16, 16, 3)), tf.float32)
    key = tf.constant([1, 2], tf.int64)
    np.testing.assert_array_equal(augment.color_jitter(image, key, 0.0), np.floor(image))
    jittered = augment.color_jitter(image, key, 0.4).numpy()
    assert 0 <= jittered.min() and jittered.max() <= 255
    np.testing.assert_array_equal(jittered, augment.color_jitter(image, key, 0.4))
    other = augment.color_jitter(image, tf.constant([3, 4], tf.int64), 0.4).numpy()
    assert not np.array_equal(jittered, other) and not np.array_equal(jittered, image)
