"""timm's RandAugment and RandomErasing as TF ops for the tf.data host pipeline.

The DeiT/RVT recipe of the official code (docs/method.md, "Recipes") runs timm's
`rand-m9-mstd0.5-inc1` RandAugment on the PIL crop and `RandomErasing` (mode
'pixel') on the normalised tensor; here the host draws each erasing box and the
accelerator fills it (`rspc_jax.data.on_device`). Every random draw here is a stateless TF op
keyed by the caller's example key, so augmented streams stay a pure function of
(seed, host, step). The pixel ops reproduce PIL's uint8 arithmetic, which timm
runs them with, on float32 images that hold integers in [0, 255].
"""

import math

import tensorflow as tf

from rspc_jax.data.options import RandAugmentSpec, parse_rand_augment

# timm's RandAugment fill colour, round(255 * ImageNet mean), on every dataset.
FILL = (124, 116, 104)
_LEVEL_DENOM = 10.0


# ----------------------------------------------------------------------------
# Pixel ops: PIL ImageOps / ImageEnhance on integer-valued float32 RGB
# ----------------------------------------------------------------------------


def _grey(image):
    """PIL's RGB -> L: (19595 R + 38470 G + 7471 B + 2**15) >> 16, (H, W, 1)."""
    weighted = tf.cast(image, tf.int32) * tf.constant([19595, 38470, 7471])
    grey = tf.bitwise.right_shift(tf.reduce_sum(weighted, -1) + 32768, 16)
    return tf.cast(grey, tf.float32)[..., None]


def _blend(degenerate, image, factor):
    """PIL Image.blend(degenerate, image, factor): float32 lerp cast to uint8."""
    mixed = degenerate + tf.cast(factor, tf.float32) * (image - degenerate)
    return tf.clip_by_value(tf.floor(mixed), 0.0, 255.0)


def _auto_contrast(image):
    """ImageOps.autocontrast: per channel int(x * scale - lo * scale), clipped.

    scale = 255 / (hi - lo) in float64 as in PIL; a constant channel is kept. As in PIL, a
    lookup table of the 256 values per channel, then one gather over the pixels.
    """
    lo = tf.reduce_min(image, axis=[0, 1])
    hi = tf.reduce_max(image, axis=[0, 1])
    scale = 255.0 / tf.cast(tf.maximum(hi - lo, 1.0), tf.float64)
    offset = -tf.cast(lo, tf.float64) * scale
    values = tf.range(256, dtype=tf.float64)[:, None]  # (256, 3) rows: value, columns: channel
    stretched = tf.clip_by_value(tf.floor(values * scale + offset), 0.0, 255.0)
    lut = tf.reshape(
        tf.where(hi > lo, tf.cast(stretched, tf.float32), tf.cast(values, tf.float32)), [-1]
    )
    index = tf.cast(image, tf.int32) * 3 + tf.range(3)
    return tf.gather(lut, index)


def _equalize(image):
    """ImageOps.equalize: per-channel lookup (step // 2 + pixels below) // step.

    step = (pixels - pixels at the channel's maximum) // 255; a channel with
    step 0 (e.g. a single value) is left unchanged, as in PIL.
    """
    values = tf.transpose(tf.reshape(tf.cast(image, tf.int32), [-1, 3]))
    hist = tf.math.bincount(values, minlength=256, maxlength=256, axis=-1)
    at_max = tf.gather(hist, tf.reduce_max(values, axis=1), batch_dims=1)
    step = (tf.reduce_sum(hist, axis=1) - at_max) // 255
    safe_step = tf.maximum(step, 1)[:, None]
    lut = (safe_step // 2 + tf.cumsum(hist, axis=1, exclusive=True)) // safe_step
    lut = tf.where(step[:, None] > 0, tf.minimum(lut, 255), tf.range(256)[None])
    equalized = tf.gather(lut, values, batch_dims=1)
    return tf.reshape(tf.cast(tf.transpose(equalized), tf.float32), tf.shape(image))


def _invert(image):
    return 255.0 - image


def _posterize(image, bits):
    """ImageOps.posterize: keeps the `bits` most significant bits (0 -> black)."""
    step = tf.pow(2.0, 8.0 - tf.minimum(tf.cast(bits, tf.float32), 8.0))
    return tf.floor(image / step) * step


def _solarize(image, threshold):
    """ImageOps.solarize: inverts the pixels >= threshold."""
    return tf.where(image < tf.cast(threshold, tf.float32), image, 255.0 - image)


def _solarize_add(image, add):
    """timm solarize_add: pixels < 128 get + add, saturating at 255."""
    added = tf.minimum(image + tf.cast(add, tf.float32), 255.0)
    return tf.where(image < 128.0, added, image)


def _color(image, factor):
    """ImageEnhance.Color: blend with the grey (L) image."""
    return _blend(tf.broadcast_to(_grey(image), tf.shape(image)), image, factor)


def _contrast(image, factor):
    """ImageEnhance.Contrast: blend with the grey image's mean (rounded)."""
    mean = tf.floor(tf.reduce_mean(tf.cast(_grey(image), tf.float64)) + 0.5)
    return _blend(tf.fill(tf.shape(image), tf.cast(mean, tf.float32)), image, factor)


def _brightness(image, factor):
    """ImageEnhance.Brightness: blend with black."""
    return _blend(tf.zeros_like(image), image, factor)


def _sharpness(image, factor):
    """ImageEnhance.Sharpness: blend with ImageFilter.SMOOTH of the image.

    SMOOTH is the 3x3 kernel [[1,1,1],[1,5,1],[1,1,1]] / 13, rounded to uint8;
    PIL leaves the one-pixel border unfiltered.
    """
    # 3x3 box sum as two 1-D sums of shifted slices (faster than a conv on CPU).
    rows = image[:-2] + image[1:-1] + image[2:]
    box = rows[:, :-2] + rows[:, 1:-1] + rows[:, 2:]
    smooth = (box + 4.0 * image[1:-1, 1:-1]) / 13.0
    smooth = tf.pad(tf.floor(smooth + 0.5), [[1, 1], [1, 1], [0, 0]])
    interior = tf.pad(
        tf.ones(tf.shape(image)[:2] - 2, tf.bool), [[1, 1], [1, 1]], constant_values=False
    )
    return _blend(tf.where(interior[..., None], smooth, image), image, factor)


# ----------------------------------------------------------------------------
# Geometric ops: PIL Image.transform(AFFINE) with timm's fill colour
# ----------------------------------------------------------------------------


def _affine(image, matrix):
    """PIL `transform(size, AFFINE, matrix, fillcolor=FILL)`, bilinear.

    `matrix` (a, b, c, d, e, f) maps output pixel centres (x + 0.5, y + 0.5) to
    input positions (a x + b y + c, d x + e y + f), as in PIL. Positions outside
    the input take FILL, in-bounds ones interpolate with the edge clamped, and
    the result is truncated to uint8 like PIL's bilinear filter. timm's DeiT
    recipe resamples bicubic, but TF's projective transform only offers nearest
    and bilinear, so bilinear it is.
    """
    a, b, c, d, e, f = (tf.cast(v, tf.float64) for v in matrix)
    # The op maps output pixel indices to input indices (centres at integers).
    transform = tf.stack([a, b, c + (a + b - 1.0) / 2.0, d, e, f + (d + e - 1.0) / 2.0, 0.0, 0.0])
    size = tf.shape(image)[:2]
    warped = tf.raw_ops.ImageProjectiveTransformV3(
        images=image[None],
        transforms=tf.cast(transform, tf.float32)[None],
        output_shape=size,
        fill_value=0.0,
        interpolation="BILINEAR",
        fill_mode="NEAREST",
    )[0]
    height, width = tf.unstack(tf.cast(size, tf.float64))
    # a x + b y + c over the grid of centres, as the sum of a row and a column: the same
    # products and sums as on a meshgrid, without materialising one.
    xs, ys = tf.range(width) + 0.5, (tf.range(height) + 0.5)[:, None]
    x_in = (a * xs + b * ys) + c
    y_in = (d * xs + e * ys) + f
    inside = (x_in >= 0) & (x_in < width) & (y_in >= 0) & (y_in < height)
    # The epsilon keeps float32 interpolation error off exact integer values.
    warped = tf.floor(warped + 1e-3)
    return tf.where(inside[..., None], warped, tf.constant(FILL, tf.float32))


def _rotate(image, degrees):
    """PIL `rotate(degrees)`: counter-clockwise about the image centre."""
    theta = -tf.cast(degrees, tf.float64) * (math.pi / 180.0)
    cos, sin = tf.cos(theta), tf.sin(theta)
    size = tf.cast(tf.shape(image)[:2], tf.float64)
    cx, cy = size[1] / 2.0, size[0] / 2.0
    return _affine(image, (cos, sin, cx - cos * cx - sin * cy, -sin, cos, cy + sin * cx - cos * cy))


def _shear_x(image, factor):
    return _affine(image, (1.0, factor, 0.0, 0.0, 1.0, 0.0))


def _shear_y(image, factor):
    return _affine(image, (1.0, 0.0, 0.0, factor, 1.0, 0.0))


def _translate_x_rel(image, fraction):
    """Samples from `fraction` of the width to the right (content moves left)."""
    pixels = fraction * tf.cast(tf.shape(image)[1], tf.float64)
    return _affine(image, (1.0, 0.0, pixels, 0.0, 1.0, 0.0))


def _translate_y_rel(image, fraction):
    pixels = fraction * tf.cast(tf.shape(image)[0], tf.float64)
    return _affine(image, (1.0, 0.0, 0.0, 0.0, 1.0, pixels))


# ----------------------------------------------------------------------------
# timm's magnitude -> argument rules (m in [0, 10]; `negate` flips the sign),
# in float64 like timm's Python floats
# ----------------------------------------------------------------------------


def _signed(value, negate):
    return tf.where(negate, -value, value)


def _rotate_level(m, negate):
    return _signed(m / _LEVEL_DENOM * 30.0, negate)


def _shear_level(m, negate):
    return _signed(m / _LEVEL_DENOM * 0.3, negate)


def _translate_rel_level(m, negate):
    return _signed(m / _LEVEL_DENOM * 0.45, negate)


def _enhance_level(m, negate):
    del negate
    return m / _LEVEL_DENOM * 1.8 + 0.1


def _enhance_increasing_level(m, negate):
    return tf.maximum(1.0 + _signed(m / _LEVEL_DENOM * 0.9, negate), 0.1)


def _posterize_level(m, negate):
    del negate
    return tf.floor(m / _LEVEL_DENOM * 4.0)


def _posterize_increasing_level(m, negate):
    return 4.0 - _posterize_level(m, negate)


def _solarize_level(m, negate):
    del negate
    return tf.floor(m / _LEVEL_DENOM * 256.0)


def _solarize_increasing_level(m, negate):
    return 256.0 - _solarize_level(m, negate)


def _solarize_add_level(m, negate):
    del negate
    return tf.floor(m / _LEVEL_DENOM * 110.0)


# name -> (op, level rule or None for ops without an argument)
_OPS = {
    "AutoContrast": (_auto_contrast, None),
    "Equalize": (_equalize, None),
    "Invert": (_invert, None),
    "Rotate": (_rotate, _rotate_level),
    "Posterize": (_posterize, _posterize_level),
    "PosterizeIncreasing": (_posterize, _posterize_increasing_level),
    "Solarize": (_solarize, _solarize_level),
    "SolarizeIncreasing": (_solarize, _solarize_increasing_level),
    "SolarizeAdd": (_solarize_add, _solarize_add_level),
    "Color": (_color, _enhance_level),
    "ColorIncreasing": (_color, _enhance_increasing_level),
    "Contrast": (_contrast, _enhance_level),
    "ContrastIncreasing": (_contrast, _enhance_increasing_level),
    "Brightness": (_brightness, _enhance_level),
    "BrightnessIncreasing": (_brightness, _enhance_increasing_level),
    "Sharpness": (_sharpness, _enhance_level),
    "SharpnessIncreasing": (_sharpness, _enhance_increasing_level),
    "ShearX": (_shear_x, _shear_level),
    "ShearY": (_shear_y, _shear_level),
    "TranslateXRel": (_translate_x_rel, _translate_rel_level),
    "TranslateYRel": (_translate_y_rel, _translate_rel_level),
}


def apply_op(image, name, magnitude, negate=False):
    """Applies timm's RandAugment op `name` at `magnitude` (no clipping, no coin).

    `image`: float32 (H, W, 3) holding integers in [0, 255]; `negate` takes the
    negative branch of the signed ops (Rotate, Shear*, Translate*, *Increasing
    enhancements), which timm picks with probability 1/2.
    """
    op, level = _OPS[name]
    if level is None:
        return op(image)
    return op(image, level(tf.cast(magnitude, tf.float64), negate))


# ----------------------------------------------------------------------------
# RandAugment
# ----------------------------------------------------------------------------


def _sample_magnitude(spec: RandAugmentSpec, key):
    """timm: N(m, mstd) (or U(0, m) for infinite mstd), clipped to [0, mmax]."""
    magnitude = float(spec.magnitude)
    if spec.magnitude_std == math.inf:
        magnitude = tf.random.stateless_uniform([], key, 0.0, magnitude)
    elif spec.magnitude_std > 0:
        magnitude += spec.magnitude_std * tf.random.stateless_normal([], key)
    return tf.clip_by_value(magnitude, 0.0, float(spec.magnitude_max))


def _one_layer(image, key, spec: RandAugmentSpec):
    """One RandAugment draw: pick an op, flip the coin, apply it."""
    op_key, coin_key, magnitude_key, sign_key = tf.unstack(
        tf.random.experimental.stateless_split(key, 4)
    )
    index = tf.random.stateless_uniform([], op_key, 0, len(spec.ops), dtype=tf.int32)
    magnitude = _sample_magnitude(spec, magnitude_key)
    negate = tf.random.stateless_uniform([], sign_key) < 0.5
    branches = [lambda name=name: apply_op(image, name, magnitude, negate) for name in spec.ops]
    applied = tf.random.stateless_uniform([], coin_key) < spec.prob
    augmented = tf.cond(applied, lambda: tf.switch_case(index, branches), lambda: image)
    return tf.ensure_shape(augmented, image.shape)


def rand_augment(image, key, spec):
    """timm RandAugment: `num_layers` ops drawn uniformly with replacement.

    As in timm (`np.random.choice(ops, n, replace=True)` without weights), the
    same op can be drawn twice; each draw is applied with probability `prob`
    at a magnitude sampled per application. `image`: (H, W, 3) in [0, 255],
    rounded to uint8 values first as timm works on PIL images; `key`: a
    stateless seed; `spec`: a string for `parse_rand_augment` or its result.
    Returns float32 (H, W, 3) holding integers in [0, 255].
    """
    if isinstance(spec, str):
        spec = parse_rand_augment(spec)
    image = tf.round(tf.clip_by_value(tf.cast(image, tf.float32), 0.0, 255.0))
    for layer in range(spec.num_layers):
        image = _one_layer(image, tf.random.experimental.stateless_fold_in(key, layer), spec)
    return image


# ----------------------------------------------------------------------------
# Random erasing
# ----------------------------------------------------------------------------


def color_jitter(image, key, strength: float):
    """torchvision ColorJitter(strength, strength, strength) on a float image in
    [0, 255]: brightness, contrast and saturation (PIL ImageEnhance, as above) with
    factors U[max(0, 1 - strength), 1 + strength], applied in a random order."""
    factor_key, order_key = tf.unstack(tf.random.experimental.stateless_split(key))
    factors = tf.random.stateless_uniform([3], factor_key, max(0.0, 1.0 - strength), 1.0 + strength)
    ops = (
        lambda x: _brightness(x, factors[0]),
        lambda x: _contrast(x, factors[1]),
        lambda x: _color(x, factors[2]),
    )
    orders = [
        (a, b, c) for a in range(3) for b in range(3) for c in range(3) if len({a, b, c}) == 3
    ]

    def apply(order):
        def run():
            out = image
            for i in order:
                out = ops[i](out)
            return out

        return run

    index = tf.random.stateless_uniform([], order_key, 0, len(orders), dtype=tf.int32)
    return tf.switch_case(index, [apply(order) for order in orders])


def erasing_box(
    shape, key, prob, *, min_area=0.02, max_area=1 / 3, min_aspect=0.3, max_attempts=10
):
    """timm RandomErasing(prob, mode='pixel', max_count=1)'s draws for one image of `shape`
    (H, W, C): (box, noise key).

    With probability `prob`, tries up to `max_attempts` rectangles of area fraction
    U(min_area, max_area) and log-uniform aspect ratio in [min_aspect, 1 / min_aspect]; the
    first that fits strictly inside the image is the box, int32 (top, left, height, width).
    If the coin says no or none fits, height and width are 0 (the image stays as it is, as
    in timm). The box is filled with per-pixel, per-channel N(0, 1) values of the
    *normalised* image, drawn from the noise key (uint32 (2,), a threefry key) on the
    accelerator (`on_device.erase`).
    """
    coin_key, shape_key, top_key, left_key, noise_key = tf.unstack(
        tf.random.experimental.stateless_split(key, 5)
    )
    height, width = shape[0], shape[1]
    area = float(height * width)
    draws = tf.random.stateless_uniform([max_attempts, 2], shape_key)
    target = (min_area + (max_area - min_area) * draws[:, 0]) * area
    log_lo, log_hi = math.log(min_aspect), math.log(1 / min_aspect)
    aspect = tf.exp(log_lo + (log_hi - log_lo) * draws[:, 1])
    heights = tf.cast(tf.round(tf.sqrt(target * aspect)), tf.int32)
    widths = tf.cast(tf.round(tf.sqrt(target / aspect)), tf.int32)
    fits = (heights < height) & (widths < width)
    first = tf.argmax(tf.cast(fits, tf.int32), output_type=tf.int32)
    h, w = heights[first], widths[first]
    # Clamped so that the draws stay valid when no attempt fits.
    top = tf.random.stateless_uniform([], top_key, 0, tf.maximum(height - h, 0) + 1, dtype=tf.int32)
    left = tf.random.stateless_uniform(
        [], left_key, 0, tf.maximum(width - w, 0) + 1, dtype=tf.int32
    )
    coin = tf.random.stateless_uniform([], coin_key)
    erase = tf.cast((coin < prob) & tf.reduce_any(fits), tf.int32)
    box = tf.stack([top, left, h * erase, w * erase])
    noise = tf.random.stateless_uniform([2], noise_key, None, None, dtype=tf.uint32)
    return box, noise
