"""The CPU forms of the models' window ops (convolutions as im2col matrix products,
depthwise convolutions as shifted products, max-pooling as a maximum of shifted views)
against XLA's convolution and pooling (the accelerator path): values, gradients and
parameter layouts; and the fused attention (GPUs) against the explicit softmax."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rspc_jax import models
from rspc_jax.models import cpu_ops, layers, ops


def _assert_same_values_and_gradients(fn, expected_fn, *args):
    key_t = jax.random.PRNGKey(7)
    expected = expected_fn(*args)
    got = fn(*args)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    target = jax.random.normal(key_t, expected.shape)
    argnums = tuple(range(len(args)))
    grads = jax.grad(lambda *a: jnp.sum(fn(*a) * target), argnums)(*args)
    expected_grads = jax.grad(lambda *a: jnp.sum(expected_fn(*a) * target), argnums)(*args)
    for g, e in zip(grads, expected_grads):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-4)


def _input_and_kernel(spatial: int, channels: int, kernel_shape: tuple[int, ...]):
    key_x, key_k = jax.random.split(jax.random.PRNGKey(0))
    return (
        jax.random.normal(key_x, (2, spatial, spatial, channels)),
        jax.random.normal(key_k, kernel_shape),
    )


DENSE_CASES = {  # name: (in, out, kernel, strides, padding, size)
    "rvt_stem_7x7_stride2": (3, 8, 7, 2, 2, 20),
    "patch_embedding_4x4_stride4": (4, 6, 4, 4, 0, 16),
    "pointwise_1x1": (5, 7, 1, 1, 0, 6),
    "conv_stem_3x3_stride2": (3, 4, 3, 2, 1, 9),
    "windows_not_dividing_the_image": (2, 3, 3, 3, 0, 8),
}


IMAGE_CASES = {  # inputs of fewer than 4 channels, for cpu_ops.conv_image
    "rvt_stem_7x7_stride2": (3, 8, 7, 2, 2, 20),
    "xcit_stem_3x3_stride2": (3, 4, 3, 2, 1, 9),
    "grey_5x5_stride3_odd_size": (1, 3, 5, 3, 2, 13),
    "two_channels_3x3_stride1": (2, 3, 3, 1, 1, 7),
}
CONV_FORMS = {  # name: (CPU form, its cases)
    "im2col": (ops.conv_im2col, DENSE_CASES),
    "blocks": (cpu_ops.conv_space_to_depth, DENSE_CASES),
    "image": (cpu_ops.conv_image, IMAGE_CASES),  # XLA's conv on 4 channels, gradients by hand
}


@pytest.mark.parametrize(
    "form, case", [(form, case) for form, (_, cases) in CONV_FORMS.items() for case in cases]
)
def test_cpu_convolution_forms_equal_xla_convolution(form, case):
    conv, cases = CONV_FORMS[form]
    channels, features, size, strides, padding, spatial = cases[case]
    x, kernel = _input_and_kernel(spatial, channels, (size, size, channels, features))
    _assert_same_values_and_gradients(
        lambda x, k: conv(x, k, strides, padding),
        lambda x, k: ops.conv_reference(x, k, strides, padding),
        x,
        kernel,
    )


@pytest.mark.parametrize("batch", [17, 35])
def test_the_image_conv_s_kernel_gradient_over_more_images_than_products(batch):
    """Past `_KERNEL_GRADIENT_PARTS` images the kernel gradient takes several images per
    product (17: 9 parts of 2, the last of 1; 35: 12 parts of 3, the last of 2)."""
    key_x, key_k, key_t = jax.random.split(jax.random.PRNGKey(5), 3)
    x = jax.random.normal(key_x, (batch, 11, 11, 3))
    kernel = jax.random.normal(key_k, (5, 5, 3, 4))
    target = jax.random.normal(key_t, (batch, 5, 5, 4))

    def kernel_gradient(conv):
        return jax.grad(lambda k: jnp.sum(conv(x, k, 2, 1) * target))(kernel)

    np.testing.assert_allclose(
        kernel_gradient(cpu_ops.conv_image),
        kernel_gradient(ops.conv_reference),
        rtol=1e-4,
        atol=1e-4,
    )


def test_cpu_convs_of_images_take_the_image_form_from_5x5_kernels():
    def traced(size: int, channels: int = 3) -> str:
        x, kernel = jnp.ones((1, 16, 16, channels)), jnp.ones((size, size, channels, 4))
        return str(jax.make_jaxpr(jax.grad(lambda x: ops.conv(x, kernel, 2, 1).sum()))(x))

    with ops.implementations(window_ops="windows"):
        assert "custom_vjp_call" in traced(7) and "custom_vjp_call" in traced(5)
        assert "conv_general_dilated" not in traced(3)  # im2col
        assert "conv_general_dilated" not in traced(7, channels=4)


def test_the_corrupted_half_s_image_gradient_skips_the_clean_half():
    """RSPC puts [corrupted; clean] through the stem and differentiates the corrupted half
    only: the compiled gradient then computes about half of the whole batch's image
    gradient, with autodiff's values."""
    if jax.default_backend() != "cpu":
        pytest.skip("checks XLA:CPU's compiled costs")
    x, kernel = _input_and_kernel(32, 3, (7, 7, 3, 8))
    x = jnp.concatenate([x, x[::-1] * 0.5])  # 4 images: 2 corrupted, 2 clean
    target = jax.random.normal(jax.random.PRNGKey(3), (4, 15, 15, 8))

    def loss(corrupted, clean, kernel, conv=cpu_ops.conv_image):
        return jnp.sum(conv(jnp.concatenate([corrupted, clean]), kernel, 2, 2) * target)

    def compiled(fn, argnums, *args):
        return jax.jit(jax.grad(fn, argnums)).lower(*args).compile(ops.compiler_options())

    halves = (x[:2], x[2:], kernel)
    corrupted_only = compiled(loss, (0, 2), *halves)
    kernel_only = compiled(loss, 2, *halves)
    whole_batch = compiled(lambda x, k: loss(x[:2], x[2:], k), (0, 1), x, kernel)
    flops = {
        name: c.cost_analysis()["flops"]
        for name, c in dict(half=corrupted_only, none=kernel_only, whole=whole_batch).items()
    }
    assert flops["half"] - flops["none"] < 0.6 * (flops["whole"] - flops["none"]), flops
    expected = jax.grad(functools.partial(loss, conv=ops.conv_reference), (0, 2))(*halves)
    for got, want in zip(corrupted_only(*halves), expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(whole_batch(x, kernel)[0][:2], expected[0], rtol=1e-4, atol=1e-4)
    odd = x[:3]  # no halves: the whole batch's gradient at once
    _assert_same_values_and_gradients(
        lambda x, k: cpu_ops.conv_image(x, k, 2, 2),
        lambda x, k: ops.conv_reference(x, k, 2, 2),
        odd,
        kernel,
    )


def test_non_overlapping_convs_are_a_matrix_product_on_every_backend():
    """Patch embeddings (and 1x1 convs) never reach XLA's convolution, whose input gradient
    XLA:GPU runs as a dilated convolution: the same values and gradients, no conv op."""
    x, kernel = _input_and_kernel(16, 3, (4, 4, 3, 6))
    for choice in ("windows", "xla"):  # CPU's and the accelerators' implementations
        with ops.implementations(window_ops=choice):
            jaxpr = str(jax.make_jaxpr(jax.grad(lambda x: ops.conv(x, kernel, 4, 0).sum()))(x))
            assert "conv_general_dilated" not in jaxpr
            _assert_same_values_and_gradients(
                lambda x, k: ops.conv(x, k, 4, 0),
                lambda x, k: ops.conv_reference(x, k, 4, 0),
                x,
                kernel,
            )
    with ops.implementations(window_ops="xla"):  # overlapping windows stay XLA's conv there
        overlapping = jax.make_jaxpr(lambda x: ops.conv(x, kernel, 2, 1))(x)
        assert "conv_general_dilated" in str(overlapping)


def test_conv_module_has_the_nn_conv_parameters_and_output():
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 9, 9, 3))
    reference = nn.Conv(4, (3, 3), strides=2, padding=((1, 1), (1, 1)), use_bias=False)
    conv = layers.Conv(4, 3, strides=2, padding=1, use_bias=False)
    variables = reference.init(jax.random.PRNGKey(2), x)
    assert jax.tree.map(jnp.shape, conv.init(jax.random.PRNGKey(2), x)) == jax.tree.map(
        jnp.shape, variables
    )
    np.testing.assert_allclose(
        conv.apply(variables, x), reference.apply(variables, x), rtol=1e-5, atol=1e-5
    )


POOL_CASES = {  # name: (size, strides, padding, height, width)
    "rvt_stem_3x3_stride2": (3, 2, 1, 11, 11),
    "odd_and_even_sides": (3, 2, 1, 10, 9),
    "stride3_unpadded": (4, 3, 0, 13, 11),
    "stride1": (3, 1, 1, 6, 7),
}


@pytest.mark.parametrize("case", POOL_CASES)
def test_max_pool_as_shifted_maximum_equals_flax_max_pool(case):
    size, strides, padding, height, width = POOL_CASES[case]
    x = jax.random.normal(jax.random.PRNGKey(3), (2, height, width, 4))  # no ties
    _assert_same_values_and_gradients(
        lambda x: cpu_ops.max_pool_windows(x, size, strides, padding),
        lambda x: ops.max_pool_reference(x, size, strides, padding),
        x,
    )


def test_max_pool_gives_a_tie_s_gradient_to_the_first_maximum_and_propagates_nan():
    """PyTorch's MaxPool2d: a window's gradient goes to its first maximum (row-major)."""
    x = jnp.zeros((1, 4, 4, 1)).at[0, 1, 1, 0].set(1.0).at[0, 1, 2, 0].set(1.0)
    grad = jax.grad(lambda x: cpu_ops.max_pool_windows(x, 2, 2, 0).sum())(x)
    expected = np.zeros((4, 4))
    expected[1, 1] = expected[1, 2] = 1.0  # each tie is in its own window
    expected[2, 0] = expected[2, 2] = 1.0  # all-zero windows: their first element
    np.testing.assert_array_equal(grad[0, :, :, 0], expected)
    tie = jnp.ones((1, 2, 2, 1))
    np.testing.assert_array_equal(
        jax.grad(lambda x: cpu_ops.max_pool_windows(x, 2, 2, 0).sum())(tie)[0, :, :, 0],
        [[1.0, 0.0], [0.0, 0.0]],
    )
    with_nan = jnp.zeros((1, 2, 2, 1)).at[0, 1, 0, 0].set(jnp.nan)
    assert np.isnan(cpu_ops.max_pool_windows(with_nan, 2, 2, 0)).all()


CASES = {  # name: (channels, multiplier, kernel, strides, padding, size)
    "rvt_mlp_3x3": (6, 1, 3, 1, 1, 7),
    "rvt_pooling_stride2_x2": (4, 2, 3, 2, 1, 7),
    "fan_convnext_7x7": (5, 1, 7, 1, 3, 8),
    "unpadded_stride2": (3, 3, 3, 2, 0, 9),
    "unpadded_3x3": (4, 1, 3, 1, 0, 7),  # smaller output than input
    "overpadded_3x3": (3, 1, 3, 1, 2, 6),  # larger output than input
}


@pytest.mark.parametrize("case", CASES)
def test_shifted_products_equal_the_grouped_convolution_and_its_gradients(case):
    channels, multiplier, size, strides, padding, spatial = CASES[case]
    x, kernel = _input_and_kernel(spatial, channels, (size, size, 1, channels * multiplier))
    _assert_same_values_and_gradients(
        lambda x, k: cpu_ops.depthwise_conv_shifted(x, k, strides, padding),
        lambda x, k: ops.grouped_conv_reference(x, k, strides, padding),
        x,
        kernel,
    )


def test_the_depthwise_kernel_gradient_of_an_odd_batch_equals_the_grouped_convolutions():
    """The kernel gradient sums each window's products over the images by halves (an odd
    count carries one image to the next level) and reads only the part of the input each
    window overlaps: 5 images, 7x7 windows of which most overhang the 8x8 input."""
    channels, _, size, _, padding, spatial = CASES["fan_convnext_7x7"]
    key_x, key_k = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(key_x, (5, spatial, spatial, channels))
    kernel = jax.random.normal(key_k, (size, size, 1, channels))
    _assert_same_values_and_gradients(
        lambda x, k: cpu_ops.depthwise_conv_shifted(x, k, 1, padding),
        lambda x, k: ops.grouped_conv_reference(x, k, 1, padding),
        x,
        kernel,
    )


def test_depthwise_conv_module_has_the_grouped_nn_conv_parameters_and_output():
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 6, 6, 4))
    grouped = nn.Conv(8, (3, 3), strides=2, padding=((1, 1), (1, 1)), feature_group_count=4)
    depthwise = layers.DepthwiseConv(8, 3, strides=2, padding=1)
    variables = grouped.init(jax.random.PRNGKey(2), x)
    assert jax.tree.map(jnp.shape, depthwise.init(jax.random.PRNGKey(2), x)) == jax.tree.map(
        jnp.shape, variables
    )
    np.testing.assert_allclose(
        depthwise.apply(variables, x), grouped.apply(variables, x), rtol=1e-5, atol=1e-5
    )


def test_output_channels_must_be_a_multiple_of_the_input_channels():
    with pytest.raises(ValueError, match="multiple of its input channels"):
        layers.DepthwiseConv(6, 3).init(jax.random.PRNGKey(0), jnp.zeros((1, 4, 4, 4)))


def test_the_switch_gives_the_same_model_on_both_implementations():
    """A whole RVT (dense, depthwise and pooling window ops; PAAS's sum over the batch)
    traced with each implementation: same logits and gradients to float32 rounding."""
    model = models.create(
        "rvt_tiny_plus", num_classes=5, base_dims=(8, 8), depth=(1, 1), heads=(2, 4), masked_block=1
    )
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 64, 64, 3))
    variables = model.init(jax.random.PRNGKey(1), x, train=False)

    def loss(params):
        logits = model.apply({**variables, "params": params}, x, train=False)
        return jnp.sum(logits**2), logits

    results = {}
    for choice, batch_sum in (("windows", "pairwise"), ("xla", "xla")):
        with ops.implementations(window_ops=choice, batch_sum=batch_sum):
            results[choice] = jax.jit(jax.value_and_grad(loss, has_aux=True))(variables["params"])
    (_, logits_w), grads_w = results["windows"]
    (_, logits_x), grads_x = results["xla"]
    np.testing.assert_allclose(logits_w, logits_x, rtol=1e-4, atol=1e-4)
    for g_w, g_x in zip(jax.tree.leaves(grads_w), jax.tree.leaves(grads_x), strict=True):
        np.testing.assert_allclose(g_w, g_x, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_a_parameter_broadcast_over_the_batch_has_the_sum_as_gradient_either_way(batch):
    """`broadcast_over_batch`'s gradient, the sum over the batch, as pairwise sums of halves
    (CPU) and as XLA's reduction: the same to float32 rounding, odd batches included."""
    shared = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 5))
    target = jax.random.normal(jax.random.PRNGKey(1), (batch, 3, 5, 5))

    def loss(shared):
        return jnp.sum(ops.broadcast_over_batch(shared, batch) * target)

    values, grads, programs = {}, {}, {}
    for choice in ("pairwise", "xla"):
        with ops.implementations(batch_sum=choice):
            values[choice] = ops.broadcast_over_batch(shared, batch)
            grads[choice] = jax.jit(jax.grad(loss))(shared)
            programs[choice] = str(jax.make_jaxpr(jax.grad(loss))(shared))
    assert programs["pairwise"] != programs["xla"]  # the switch changed the computation
    for choice in ("pairwise", "xla"):
        np.testing.assert_array_equal(values[choice], jnp.broadcast_to(shared, target.shape))
        np.testing.assert_allclose(grads[choice], jnp.sum(target, axis=0), rtol=1e-5, atol=1e-6)


def test_fused_attention_asks_for_cudnn_on_gpus_in_16_bit_only():
    """jax.nn.dot_product_attention's default is XLA's kernel on every backend, so the GPU's
    fused kernel is asked for by name, for the 16-bit inputs it takes."""
    expected = "cudnn" if jax.default_backend() == "gpu" else "xla"
    assert ops.fused_attention_kernel(jnp.bfloat16) == expected
    assert ops.fused_attention_kernel(jnp.float16) == expected
    assert ops.fused_attention_kernel(jnp.float32) == "xla"


def test_fused_attention_padded_to_an_even_token_count_is_the_same_attention():
    """For cuDNN, whose training path takes even token counts only, 197 tokens become 198
    with a masked key and the extra query dropped: same outputs and gradients (XLA's kernel
    here), with and without a logit bias."""
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v = (jax.random.normal(key, (2, 5, 3, 8)) for key in keys[:3])
    bias = jax.random.normal(keys[3], (1, 1, 5, 5))
    for logit_bias in (None, bias):

        def loss(q, k, v, pad, logit_bias=logit_bias):
            out = ops.fused_attention(q, k, v, logit_bias, 0.3, kernel="xla", pad_to_even=pad)
            return jnp.sum(out**2), out

        grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
        (_, padded), padded_grads = grad(q, k, v, True)
        (_, plain), plain_grads = grad(q, k, v, False)
        assert padded.shape == plain.shape == (2, 5, 3, 8)
        np.testing.assert_allclose(padded, plain, rtol=1e-5, atol=1e-6)
        for g_p, g in zip(padded_grads, plain_grads, strict=True):
            np.testing.assert_allclose(g_p, g, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(
    jax.default_backend() != "gpu", reason="cuDNN's fused attention kernel needs a GPU"
)
def test_cudnn_attention_equals_the_explicit_softmax_in_bfloat16():
    """On a GPU, DeiT-S's bfloat16 attention layer runs cuDNN's kernel and gives the explicit
    softmax's outputs and gradients to bfloat16 rounding."""
    attention = layers.Attention(6, maps_unused=True)
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 197, 384)).astype(jnp.bfloat16)
    params = attention.init(jax.random.PRNGKey(1), x, train=True)["params"]
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)

    def loss(params, x):
        out = attention.apply({"params": params}, x, train=True)[0].astype(jnp.float32)
        return jnp.mean(out**2), out

    results, programs = {}, {}
    for choice in ("explicit", "fused"):
        with ops.implementations(attention=choice):
            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
            programs[choice] = step.lower(params, x).as_text()
            results[choice] = step(params, x)
    assert "cudnn" in programs["fused"] and "cudnn" not in programs["explicit"]
    (_, out_f), grads_f = results["fused"]
    (_, out_e), grads_e = results["explicit"]
    np.testing.assert_allclose(out_f, out_e, rtol=2e-2, atol=2e-2)
    for g_f, g_e in zip(jax.tree.leaves(grads_f), jax.tree.leaves(grads_e), strict=True):
        g_f, g_e = np.asarray(g_f, np.float32), np.asarray(g_e, np.float32)
        assert np.abs(g_f - g_e).max() <= 0.05 * np.abs(g_e).max() + 1e-6


def test_an_unknown_choice_or_value_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="not one of .*: pass one of them"):
        with ops.implementations(window_ops="cudnn"):
            pass
    with pytest.raises(ValueError, match=r"\('auto', 'fused', 'explicit'\)"):
        with ops.implementations(attention="flash"):
            pass
    with pytest.raises(ValueError, match="name one of window_ops, attention"):
        with ops.implementations(schedule="memory"):
            pass


def test_choices_hold_inside_their_block_only_and_auto_follows_the_backend():
    """'auto' picks the CPU forms on CPU and XLA's elsewhere; a block's choices are undone
    when it ends, an inner block's on top of the outer's."""
    on_cpu = jax.default_backend() == "cpu"
    assert ops.use_window_ops() == on_cpu
    with ops.implementations(window_ops="xla", batch_sum="xla"):
        assert not ops.use_window_ops()
        with ops.implementations(window_ops="windows"):
            assert ops.use_window_ops()
        assert not ops.use_window_ops()
    assert ops.use_window_ops() == on_cpu
    with ops.implementations(cpu_schedule="xla", cpu_products="xla"):
        assert ops.compiler_options() is None
    with ops.implementations(cpu_schedule="memory", cpu_products="onednn"):
        options = ops.compiler_options() or {}
        assert bool(options.get("xla_cpu_use_onednn")) == on_cpu


def test_fused_attention_equals_the_explicit_softmax_and_keeps_requested_maps():
    """A DeiT with its unread attention as jax.nn.dot_product_attention (what GPUs run as
    cuDNN's fused kernel): same logits and gradients, unrolled and scanned; asked for its
    attention maps, it computes them the explicit way."""
    model = models.create("deit_tiny_patch16_224", num_classes=5, depth=2, drop_path_rate=0.0)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 32, 32, 3))
    variables = model.init(jax.random.PRNGKey(1), x, train=False)

    def loss(params, scan):
        logits = model.clone(scan_blocks=scan).apply({"params": params}, x, train=False)
        return jnp.sum(logits**2), logits

    results, programs = {}, {}
    for choice in ("explicit", "fused"):
        with ops.implementations(attention=choice):
            for scan in (False, True):
                step = jax.value_and_grad(functools.partial(loss, scan=scan), has_aux=True)
                results[choice, scan] = jax.jit(step)(variables["params"])
            programs[choice] = str(jax.make_jaxpr(step)(variables["params"]))
    assert programs["fused"] != programs["explicit"]  # the switch changed the computation
    for scan in (False, True):
        (_, logits_e), grads_e = results["explicit", scan]
        (_, logits_f), grads_f = results["fused", scan]
        np.testing.assert_allclose(logits_f, logits_e, rtol=1e-5, atol=1e-5)
        for g_f, g_e in zip(jax.tree.leaves(grads_f), jax.tree.leaves(grads_e), strict=True):
            np.testing.assert_allclose(g_f, g_e, rtol=1e-4, atol=1e-5)
    rvt = models.create(  # PAAS (explicit) in stage 0, fused attention in stage 1
        "rvt_tiny_plus", num_classes=5, base_dims=(8, 8), depth=(1, 1), heads=(2, 4), masked_block=1
    )
    images = jax.random.normal(jax.random.PRNGKey(4), (2, 64, 64, 3))
    rvt_vars = rvt.init(jax.random.PRNGKey(5), images, train=False)
    rvt_logits, rvt_programs = {}, {}
    for choice in ("explicit", "fused"):
        with ops.implementations(attention=choice):
            rvt_logits[choice] = rvt.apply(rvt_vars, images, train=False)
            rvt_programs[choice] = str(
                jax.make_jaxpr(lambda v: rvt.apply(v, images, train=False))(rvt_vars)
            )
    assert rvt_programs["fused"] != rvt_programs["explicit"]
    np.testing.assert_allclose(rvt_logits["fused"], rvt_logits["explicit"], rtol=1e-5, atol=1e-5)
    attention = layers.Attention(3, maps_unused=True)  # with an intervention's (N, N) bias
    tokens = jax.random.normal(jax.random.PRNGKey(2), (2, 5, 24))
    bias = jnp.where(jnp.eye(5, dtype=bool), 0.0, -1e4).at[:, 0].set(0.0)
    attention_vars = attention.init(jax.random.PRNGKey(3), tokens, train=False)
    outputs = {}
    for choice in ("explicit", "fused"):
        with ops.implementations(attention=choice):
            outputs[choice] = attention.apply(attention_vars, tokens, train=False, bias=bias)[0]
    np.testing.assert_allclose(outputs["fused"], outputs["explicit"], rtol=1e-5, atol=1e-6)
    with ops.implementations(attention="fused"):
        _, state = model.apply(
            variables, x, train=False, sow_attention=True, mutable=["intermediates"]
        )
    maps = state["intermediates"]["attention_maps"]
    assert len(maps) == 2 and maps[0].shape == (2, 3, 5, 5)
    np.testing.assert_allclose(jnp.sum(maps[0], axis=-1), 1.0, rtol=1e-5)


def test_layer_norm_gradient_equals_autodiff_of_the_two_pass_form():
    """`standardize`'s written-out backward against autodiff of the plain formula, and the
    module against flax's two-pass LayerNorm (same parameter names and values)."""
    x = 3.0 + jax.random.normal(jax.random.PRNGKey(0), (4, 7, 32))
    target = jax.random.normal(jax.random.PRNGKey(1), x.shape)

    def two_pass(x):
        centered = x - x.mean(-1, keepdims=True)
        return centered * jax.lax.rsqrt(jnp.mean(centered**2, -1, keepdims=True) + 1e-6)

    ours = jax.grad(lambda x: jnp.sum(layers.standardize(x, 1e-6) * target))(x)
    expected = jax.grad(lambda x: jnp.sum(two_pass(x) * target))(x)
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-5)
    reference = nn.LayerNorm(epsilon=1e-6, use_fast_variance=False)
    variables = reference.init(jax.random.PRNGKey(2), x)
    variables = jax.tree.map(
        lambda v: v + 0.3 * jax.random.normal(jax.random.PRNGKey(3), v.shape), variables
    )
    np.testing.assert_allclose(
        layers.LayerNorm(1e-6).apply(variables, x),
        reference.apply(variables, x),
        rtol=1e-5,
        atol=1e-5,
    )


def test_softmax_keeps_only_its_output_for_the_backward_pass():
    """In attention (map @ values, differentiated in both), `layers.softmax`'s vjp holds one
    map-sized residual, the map, where `jax.nn.softmax` with JAX's default derivative holds
    the exponentials too; the gradients agree to float32 rounding, on the last axis and on
    another."""
    logits = 4.0 * jax.random.normal(jax.random.PRNGKey(0), (2, 3, 9, 9))
    values = jax.random.normal(jax.random.PRNGKey(1), (2, 3, 9, 4))

    def attention(softmax, axis=-1):
        return lambda x, v: softmax(x, axis=axis) @ v

    def map_sized_residuals(softmax):
        _, vjp = jax.vjp(attention(softmax), logits, values)
        return sum(leaf.shape == logits.shape for leaf in jax.tree_util.tree_leaves(vjp))

    with jax.softmax_custom_jvp(False):
        assert map_sized_residuals(jax.nn.softmax) == 2
        assert map_sized_residuals(layers.softmax) == 1
        for axis in (-1, 1):

            def loss(softmax, axis=axis):
                return lambda x, v: jnp.sum(jnp.sin(attention(softmax, axis)(x, v)))

            expected = jax.grad(loss(jax.nn.softmax), argnums=(0, 1))(logits, values)
            ours = jax.grad(loss(layers.softmax), argnums=(0, 1))(logits, values)
            for a, b in zip(ours, expected):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_gelu_gradient_is_autodiff_s_and_the_backward_pass_keeps_only_the_input():
    """`layers.gelu`'s written-out backward against autodiff of the formula, and what a
    compiled MLP gradient keeps: the input of GELU, not its erf too (XLA would merge an erf
    written like the forward's into it and keep one more hidden-width array)."""
    x = jnp.concatenate([jnp.linspace(-12.0, 12.0, 97), jnp.array([0.0, -0.0, 1e-30])])

    def formula(x):
        return 0.5 * x * (1.0 + jax.lax.erf(x * 0.7071067811865476))

    np.testing.assert_allclose(layers.gelu(x), formula(x), rtol=1e-6, atol=1e-7)
    ours = jax.grad(lambda x: jnp.sum(jnp.sin(layers.gelu(x))))(x)
    expected = jax.grad(lambda x: jnp.sum(jnp.sin(formula(x))))(x)
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-7)
    _, vjp = jax.vjp(layers.gelu, x)
    assert [leaf.shape for leaf in jax.tree_util.tree_leaves(vjp)] == [x.shape]

    inputs = jax.random.normal(jax.random.PRNGKey(0), (512, 64))
    w1 = jax.random.normal(jax.random.PRNGKey(1), (64, 256)) / 8
    w2 = jax.random.normal(jax.random.PRNGKey(2), (256, 64)) / 16

    def temp_bytes(activation):
        def loss(w1, w2):
            return jnp.sum(jnp.sin(activation(inputs @ w1) @ w2))

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(w1, w2).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    hidden = 512 * 256 * 4
    assert temp_bytes(layers.gelu) <= temp_bytes(formula) - hidden


def _dense_reference(x, kernel):
    return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


@pytest.mark.parametrize("features", [24, 5])  # the input (8 wide) narrower, then wider
def test_layerwise_dense_gradient_is_autodiff_s(features):
    """`ops.linear`'s CPU backward (the narrower operand transposed, the input gradient tied
    to the kernel's) against autodiff of the product, for every set of inputs that take a
    gradient; where only one does, the other's is not computed (None in the vjp's
    residuals)."""
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 7, 8))
    kernel = jax.random.normal(jax.random.PRNGKey(1), (8, features)) / 3
    with ops.implementations(dense_gradient="layerwise"):
        _assert_same_values_and_gradients(ops.linear, _dense_reference, x, kernel)
        for argnums in ((0,), (1,)):

            def loss(fn, *args):
                return jnp.sum(jnp.sin(fn(*args)))

            ours = jax.jit(jax.grad(functools.partial(loss, ops.linear), argnums))(x, kernel)
            expected = jax.grad(functools.partial(loss, _dense_reference), argnums)(x, kernel)
            np.testing.assert_allclose(ours[0], expected[0], rtol=1e-5, atol=1e-5)
        _, vjp = jax.vjp(lambda x: ops.linear(x, kernel), x)
        kept = [leaf.shape for leaf in jax.tree_util.tree_leaves(vjp)]
        assert x.shape not in kept and kernel.shape in kept


@pytest.mark.parametrize("widths", [(5, 4), (4, 9)])  # (k, n): b's gradient both ways
def test_untransposed_batched_gradient_is_autodiff_s_without_transposed_products(widths):
    """`ops.batched_matmul`'s CPU backward (attention's products with oneDNN's products):
    the same values and gradients as autodiff's, and no compiled product contracts the
    second-to-last axis of its first operand (a transposed operand, which oneDNN runs
    slower)."""
    if jax.default_backend() != "cpu":
        pytest.skip("checks XLA:CPU's compiled products")
    k, n = widths
    a = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 6, k))
    b = jax.random.normal(jax.random.PRNGKey(1), (2, 3, k, n))
    with ops.implementations(batched_gradient="untransposed", cpu_products="onednn"):
        _assert_same_values_and_gradients(ops.batched_matmul, jnp.matmul, a, b)
        grad = jax.jit(jax.grad(lambda a, b: jnp.sum(jnp.sin(ops.batched_matmul(a, b))), (0, 1)))
        hlo = grad.lower(a, b).compile(ops.compiler_options()).as_text()
    transposed = [line for line in hlo.splitlines() if "lhs_contracting_dims={2}" in line]
    assert not transposed, transposed
    assert "lhs_contracting_dims={3}" in hlo


def test_dense_layers_use_the_backends_product_with_the_same_parameters():
    """`layers.dense` is `nn.Dense` with `ops.linear`: the same parameter tree and values;
    any other contraction is refused with a message naming the fix."""
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 6))
    ours, theirs = layers.dense(4, name="fc"), nn.Dense(4, name="fc")
    params = theirs.init(jax.random.PRNGKey(1), x)
    assert jax.tree.map(jnp.shape, ours.init(jax.random.PRNGKey(1), x)) == jax.tree.map(
        jnp.shape, params
    )
    np.testing.assert_allclose(ours.apply(params, x), theirs.apply(params, x), rtol=1e-6)
    with pytest.raises(ValueError, match="jax.lax.dot_general"):
        ops.dense_dot_general(x, x, (((2,), (2,)), ((0,), (0,))))


def test_layerwise_dense_gradient_frees_each_layer_before_the_next():
    """The compiled gradient of a stack of dense layers under XLA:CPU's memory-optimized
    schedule (the steps' on CPU): with autodiff's backward, the schedule keeps every
    layer's kernel gradient, and the activations it reads, for the end; with the layerwise
    one it computes each as it reaches the layer, so the temporaries are smaller by more
    than two layers' activations. No kernel gradient is a product with transposed operands
    (Eigen's on XLA:CPU), and an input gradient alone costs no kernel gradients."""
    if jax.default_backend() != "cpu":
        pytest.skip("checks XLA:CPU's schedule and products")
    depth, tokens, width = 6, 2048, 128
    x = jax.random.normal(jax.random.PRNGKey(0), (tokens, width))
    kernels = [
        jax.random.normal(jax.random.PRNGKey(i), (width, width)) / width**0.5
        for i in range(1, depth + 1)
    ]

    def loss(kernels, x):
        for kernel in kernels:
            x = jnp.tanh(ops.linear(x, kernel))
        return jnp.sum(x)

    def compiled(choice, argnums):
        with ops.implementations(dense_gradient=choice):
            grad = jax.jit(jax.grad(loss, argnums))
            return grad.lower(kernels, x).compile(ops.compiler_options())

    autodiff, layerwise = compiled("xla", 0), compiled("layerwise", 0)
    activation = tokens * width * 4
    temp = {c: c.memory_analysis().temp_size_in_bytes for c in (autodiff, layerwise)}
    assert temp[layerwise] < temp[autodiff] - 2 * activation, (temp, activation)
    transposed = [
        line for line in layerwise.as_text().splitlines() if "lhs_contracting_dims={0}" in line
    ]
    assert not transposed, transposed
    np.testing.assert_allclose(
        jax.tree.leaves(layerwise(kernels, x)),
        jax.tree.leaves(autodiff(kernels, x)),
        rtol=1e-4,
        atol=1e-4,
    )
    flops = {
        choice: compiled(choice, 1).cost_analysis()["flops"] for choice in ("xla", "layerwise")
    }
    assert flops["layerwise"] <= flops["xla"] * 1.01, flops
