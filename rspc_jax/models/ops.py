"""Backend-specific choices behind one switch each, so the models and steps read the same on
every backend: window ops (dense and depthwise convolution, max-pooling), attention whose maps
are not needed (`use_fused_attention`), the gradient of a parameter shared by every example
(`broadcast_over_batch`), the backward pass of a dense layer's product (`linear`), and
XLA:CPU's instruction schedule and matrix-product library for the jitted steps
(`compiler_options`).

XLA:CPU runs convolutions, grouped convolutions and the pooling gradient far slower than
matrix products and elementwise ops, so on CPU these ops are written as gathered windows
(im2col products, shifted multiply-adds, a maximum of shifted views; for a large kernel on
images, XLA's conv on a fourth zero channel, `conv_image`); GPUs and TPUs run
XLA's own ops, which their compilers handle well. Both give the same numbers to float32
rounding (tests/test_layers.py). The switch: `RSPC_JAX_WINDOW_OPS` = auto (default: windows
on CPU, XLA's ops elsewhere) | windows | xla, or `implementation(...)` in code.
"""

import contextlib
import functools
import os

import flax.linen as nn
import jax
import jax.numpy as jnp

from rspc_jax import ConfigError

# Every switch by its environment variable (`override`).
_SWITCHES: dict[str, "_Switch"] = {}


class _Switch:
    """An implementation choice: an environment variable's value (default 'auto'), which
    `override` replaces inside a block; read when the models are traced."""

    def __init__(self, variable: str, choices: tuple[str, ...]):
        self.variable, self.choices = variable, choices
        self.value = os.environ.get(variable, "auto")
        _SWITCHES[variable] = self

    def get(self) -> str:
        if self.value not in self.choices:
            raise ConfigError(
                f"the environment variable {self.variable}={self.value!r} is not one of "
                f"{self.choices}: set it to one of them, or unset it for 'auto'"
            )
        return self.value

    @contextlib.contextmanager
    def override(self, choice: str):
        if choice not in self.choices:
            raise ConfigError(
                f"{self.variable} choice {choice!r} is not one of {self.choices}: pass one of "
                "them (the same values the environment variable takes)"
            )
        previous, self.value = self.value, choice
        try:
            yield
        finally:
            self.value = previous


_window_ops = _Switch("RSPC_JAX_WINDOW_OPS", ("auto", "windows", "xla"))
_attention = _Switch("RSPC_JAX_ATTENTION", ("auto", "fused", "explicit"))
_cpu_schedule = _Switch("RSPC_JAX_CPU_SCHEDULE", ("auto", "xla"))
_cpu_products = _Switch("RSPC_JAX_CPU_PRODUCTS", ("auto", "xla"))
_batch_sum = _Switch("RSPC_JAX_BATCH_SUM", ("auto", "pairwise", "xla"))
_dense_gradient = _Switch("RSPC_JAX_DENSE_GRADIENT", ("auto", "layerwise", "xla"))
_batched_gradient = _Switch("RSPC_JAX_BATCHED_GRADIENT", ("auto", "untransposed", "xla"))


def override(variable: str, choice: str):
    """The switch named by its environment variable set to `choice` in the block: how the
    benchmark compiles one step under two choices for a same-process A/B."""
    if variable not in _SWITCHES:
        raise ConfigError(
            f"{variable!r} is not a switch of rspc_jax.models.ops: name one of "
            f"{', '.join(sorted(_SWITCHES))}"
        )
    return _SWITCHES[variable].override(choice)


def use_window_ops() -> bool:
    """Whether models trace the window implementations."""
    choice = _window_ops.get()
    return choice == "windows" or (choice == "auto" and jax.default_backend() == "cpu")


def implementation(choice: str):
    """Traces the models with window ops `choice` ('auto', 'windows' or 'xla') in the block."""
    return _window_ops.override(choice)


def use_fused_attention() -> bool:
    """Whether attention whose maps nobody reads is `jax.nn.dot_product_attention` (cuDNN's
    fused kernel on GPUs in 16-bit, `fused_attention_kernel`) rather than the explicit
    softmax of the logits. `RSPC_JAX_ATTENTION` = auto (default: fused on GPU only; on
    XLA:CPU it is slower: 26 against 19 ms forward+backward of DeiT-S's attention core at
    batch 8) | fused | explicit, or `attention_implementation(...)` in code. The same values
    to float32 rounding (tests/test_layers.py)."""
    choice = _attention.get()
    return choice == "fused" or (choice == "auto" and jax.default_backend() == "gpu")


def fused_attention_kernel(dtype) -> str:
    """`jax.nn.dot_product_attention`'s implementation for inputs of `dtype`: cuDNN's fused
    (flash) kernel on GPUs, which takes 16-bit inputs only; XLA's elsewhere. jax.nn's own
    default (None) is XLA's on every backend, so it must be asked for by name."""
    sixteen_bit = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "cudnn" if sixteen_bit and jax.default_backend() == "gpu" else "xla"


def fused_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    scale: float,
    *,
    kernel: str | None = None,
    pad_to_even: bool | None = None,
) -> jax.Array:
    """`jax.nn.dot_product_attention` of (B, N, heads, head_dim) inputs with `kernel`
    (default `fused_attention_kernel`). jax's cuDNN path refuses an odd token count in
    training (197 for a 224 px ViT with its class token), so for cuDNN (`pad_to_even`
    default) the tokens are padded to an even count with a masked key, and the padded
    query's row is dropped: the same attention of the real tokens."""
    kernel = kernel or fused_attention_kernel(q.dtype)
    if pad_to_even is None:
        pad_to_even = kernel == "cudnn"
    tokens = q.shape[1]
    if not pad_to_even or tokens % 2 == 0:
        return jax.nn.dot_product_attention(q, k, v, bias=bias, scale=scale, implementation=kernel)
    q, k, v = (jnp.pad(t, ((0, 0), (0, 1), (0, 0), (0, 0))) for t in (q, k, v))
    if bias is not None:
        bias = jnp.pad(bias, ((0, 0), (0, 0), (0, 1), (0, 1)))
    real_keys = jnp.arange(tokens + 1) < tokens
    mask = jnp.broadcast_to(real_keys, (1, 1, tokens + 1, tokens + 1))
    out = jax.nn.dot_product_attention(
        q, k, v, bias=bias, mask=mask, scale=scale, implementation=kernel
    )
    return out[:, :tokens]


def attention_implementation(choice: str):
    """Traces the models with attention `choice` ('auto', 'fused', 'explicit') in the block."""
    return _attention.override(choice)


def broadcast_over_batch(x: jax.Array, batch: int) -> jax.Array:
    """`batch` copies of `x` along a new leading axis: a parameter that every example uses
    (RVT*'s PAAS mask). Its gradient is the sum over that axis, which XLA:CPU runs 9-19
    times slower than the same adds written as pairwise sums of halves when the summed
    arrays are large (at batch 8, RVT-Ti*'s PAAS mask gradient took 7.2 against 0.5 ms; the
    ten took 13% of its step's op time; docs/speed.md, "CPU: sums over the batch").
    `RSPC_JAX_BATCH_SUM` = auto (default: pairwise on CPU, XLA's reduction elsewhere) |
    pairwise | xla, or `batch_sum_implementation(...)` in code. The same values to float32
    rounding."""
    choice = _batch_sum.get()
    if choice == "pairwise" or (choice == "auto" and jax.default_backend() == "cpu"):
        return _broadcast_summed_pairwise(x, batch)
    return jnp.broadcast_to(x, (batch,) + x.shape)


def batch_sum_implementation(choice: str):
    """Traces the models with batch sums `choice` ('auto', 'pairwise', 'xla') in the block."""
    return _batch_sum.override(choice)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _broadcast_summed_pairwise(x: jax.Array, batch: int) -> jax.Array:
    return _broadcast_summed_pairwise_fwd(x, batch)[0]


def _broadcast_summed_pairwise_fwd(x, batch):
    return jnp.broadcast_to(x, (batch,) + x.shape), None


def _broadcast_summed_pairwise_bwd(batch, residuals, grad):
    return (_sum_of_halves(grad.astype(jnp.float32)).astype(grad.dtype),)


def _sum_of_halves(x: jax.Array) -> jax.Array:
    """The sum over the leading axis as pairwise sums of halves (an odd leftover carried to
    the next level): elementwise adds, which XLA:CPU fuses with the ops that produce `x`
    and runs far faster than its reduction over a leading axis."""
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        pairs = x[:half] + x[half : 2 * half]
        x = jnp.concatenate([pairs, x[2 * half :]]) if x.shape[0] % 2 else pairs
    return x[0]


_broadcast_summed_pairwise.defvjp(_broadcast_summed_pairwise_fwd, _broadcast_summed_pairwise_bwd)


def _dense_dimensions(ndim: int):
    return ((ndim - 1,), (0,)), ((), ())


def linear(x: jax.Array, kernel: jax.Array, precision=None) -> jax.Array:
    """x (..., in) @ kernel (in, out), a dense layer's product (`layers.dense`, 1x1 and
    patch convolutions). On CPU its backward pass is `_linear_layerwise`'s.
    `RSPC_JAX_DENSE_GRADIENT` = auto (default: layerwise on CPU, autodiff's elsewhere) |
    layerwise | xla, or `dense_gradient_implementation(...)` in code. The same values to
    float32 rounding (tests/test_layers.py)."""
    choice = _dense_gradient.get()
    if choice == "layerwise" or (choice == "auto" and jax.default_backend() == "cpu"):
        return _linear_layerwise(x, kernel, precision)
    return jax.lax.dot_general(x, kernel, _dense_dimensions(x.ndim), precision=precision)


def dense_gradient_implementation(choice: str):
    """Traces the models with dense gradients `choice` ('auto', 'layerwise', 'xla') in the
    block."""
    return _dense_gradient.override(choice)


def dense_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """`nn.Dense`'s `dot_general` argument: its product as `linear`."""
    if dimension_numbers != _dense_dimensions(lhs.ndim) or preferred_element_type is not None:
        raise ValueError(
            f"dense_dot_general takes nn.Dense's product only (contracting the input's last "
            f"axis with the kernel's first, no preferred element type), not "
            f"{dimension_numbers} with {preferred_element_type}: call jax.lax.dot_general"
        )
    return linear(lhs, rhs, precision)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _linear_layerwise(x: jax.Array, kernel: jax.Array, precision) -> jax.Array:
    """`linear` with a backward pass written for XLA:CPU (docs/speed.md, "CPU: dense
    layers' weight gradients (2026-12-02)"). Two things differ from autodiff's, neither a
    value:
    - The kernel's gradient contracts the tokens of the input and of the output's gradient.
      XLA:CPU wrote it as a product with both operands transposed, which it hands to
      Eigen, after copying the output's gradient into a transposed layout. Here the
      narrower operand is transposed behind an optimization barrier (so XLA cannot fold the
      transpose back) and the product is an untransposed one, which XLA gives YNNPACK.
    - The input's gradient is made to depend on the kernel's (plus 0 x its sum, which XLA
      does not fold away), so the memory-optimized schedule computes each layer's kernel
      gradient before it moves on to the layer below, and frees that layer's input and
      output gradient. Autodiff leaves the kernel gradients free to wait, and the
      schedule kept them for the end of the backward pass (XLA's estimate of RVT-Ti*'s
      RSPC step at batch 8: 1642 against 1492 MiB). A non-finite kernel gradient makes
      the input's non-finite too; where the kernel takes no gradient (an attack's input
      gradient) none is computed."""
    return jax.lax.dot_general(x, kernel, _dense_dimensions(x.ndim), precision=precision)


def _linear_layerwise_fwd(x, kernel, precision):
    """Keeps only what the gradients asked for need: no input where the kernel takes no
    gradient (an attack's input gradient), no kernel where the input takes none."""
    y = jax.lax.dot_general(
        x.value, kernel.value, _dense_dimensions(x.value.ndim), precision=precision
    )
    return y, (x.value if kernel.perturbed else None, kernel.value if x.perturbed else None)


def _linear_layerwise_bwd(precision, residuals, grad):
    x, kernel = residuals
    if isinstance(grad, jax.custom_derivatives.SymbolicZero):
        return None, None
    grad_x = grad_kernel = None
    if kernel is not None:
        dimensions = (((grad.ndim - 1,), (1,)), ((), ()))
        grad_x = jax.lax.dot_general(grad, kernel, dimensions, precision=precision)
    if x is not None:
        x, grad = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        grad_kernel = _transposed_product(x, grad, precision)
    if grad_x is not None and grad_kernel is not None:
        grad_x = grad_x + (jnp.sum(grad_kernel) * 0).astype(grad_x.dtype)
    return grad_x, grad_kernel


_linear_layerwise.defvjp(_linear_layerwise_fwd, _linear_layerwise_bwd, symbolic_zeros=True)


def _transposed_product(a: jax.Array, b: jax.Array, precision=None) -> jax.Array:
    """a^T @ b over any leading batch axes (contracting the second-to-last axis of both)
    as a product of untransposed operands: the narrower one is transposed behind an
    optimization barrier, and the result stays behind one, so that XLA cannot fold the
    transposes back into a product with a transposed operand, which XLA:CPU runs slower (Eigen's
    under jaxlib's default products; oneDNN's batched ones at 1.8 times the time)."""
    barrier = jax.lax.optimization_barrier
    swap = functools.partial(jnp.swapaxes, axis1=-1, axis2=-2)
    if a.shape[-1] <= b.shape[-1]:
        return barrier(jnp.matmul(barrier(swap(a)), b, precision=precision))
    # the transposed product, whose own transpose is a copy of the small result
    return swap(barrier(jnp.matmul(barrier(swap(b)), a, precision=precision)))


def batched_matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """a (..., m, k) @ b (..., k, n) over leading batch axes: attention's two products.
    With oneDNN's products on CPU (`cpu_products`) the gradient of b is
    `_transposed_product`'s: autodiff's contracts the tokens of a and of the output's
    gradient, a product with a transposed operand, which oneDNN ran at 1.8 times the time
    of the untransposed one (8 x 6 x 196 x 196 by 196 x 32; docs/speed.md, "CPU:
    attention's gradients without transposed products (2026-12-02, Zen 4)"). The same
    values to float32 rounding (tests/test_layers.py). `RSPC_JAX_BATCHED_GRADIENT` = auto
    (default: untransposed with oneDNN's products on CPU, autodiff's elsewhere) |
    untransposed | xla, or `batched_gradient_implementation(...)` in code."""
    choice = _batched_gradient.get()
    on_onednn = jax.default_backend() == "cpu" and _cpu_products.get() == "auto"
    if choice == "untransposed" or (choice == "auto" and on_onednn):
        return _batched_matmul_untransposed(a, b)
    return jnp.matmul(a, b)


def batched_gradient_implementation(choice: str):
    """Traces the models with batched products' gradients `choice` ('auto', 'untransposed',
    'xla') in the block."""
    return _batched_gradient.override(choice)


@jax.custom_vjp
def _batched_matmul_untransposed(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.matmul(a, b)


def _batched_matmul_untransposed_fwd(a, b):
    return jnp.matmul(a, b), (a, b)


def _batched_matmul_untransposed_bwd(residuals, grad):
    a, b = residuals
    return jnp.matmul(grad, jnp.swapaxes(b, -1, -2)), _transposed_product(a, grad)


_batched_matmul_untransposed.defvjp(
    _batched_matmul_untransposed_fwd, _batched_matmul_untransposed_bwd
)


def compiler_options() -> dict[str, str | bool] | None:
    """XLA options for jitting the train and eval steps, read when they are jitted.

    On CPU, two choices, each with its own switch:
    - The memory-optimized instruction schedule: XLA:CPU's default orders independent ops so
      that its threads can run them concurrently, which keeps their buffers alive together;
      with the memory schedule XLA's estimate of the train step at batch 8 falls from 857
      to 710 MiB for RVT-Ti* (RSPC: 1575 to 1492) and from 957 to 900 MiB for DeiT-S (RSPC:
      1625 to 1496; docs/speed.md, "CPU: dense layers' weight gradients (2026-12-02)"), and
      the steps run as fast or faster on 2 cores (docs/speed.md, "CPU: the memory-optimized
      schedule"). `RSPC_JAX_CPU_SCHEDULE` = auto (default) | xla (XLA's own schedule), or
      `cpu_schedule(...)` in code. Scheduling does not change any value.
    - oneDNN's matrix products, each product alone: jaxlib's default library (YNNPACK) runs
      a batched product (attention's) on one thread, oneDNN on all cores. Only products
      alone: oneDNN's products fused with elementwise ops crash XLA:CPU on RVT*'s attention
      (jaxlib 0.10.2). `RSPC_JAX_CPU_PRODUCTS` = auto (default: oneDNN) | xla (jaxlib's
      default), or `cpu_products(...)` in code. The products agree to float32
      rounding (docs/speed.md, "CPU: oneDNN's products for the steps (2026-12-02)")."""
    if jax.default_backend() != "cpu":
        return None
    options = {}
    if _cpu_schedule.get() == "auto":
        options["xla_cpu_scheduler_type"] = "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"
    if _cpu_products.get() == "auto":
        options["xla_cpu_use_onednn"] = True
        options["xla_cpu_experimental_onednn_fusion_type"] = "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"
    return options or None


def cpu_schedule(choice: str):
    """Jits the steps with XLA:CPU schedule `choice` ('auto', 'xla') in the block."""
    return _cpu_schedule.override(choice)


def cpu_products(choice: str):
    """Jits the steps with XLA:CPU's products `choice` ('auto', 'xla') in the block."""
    return _cpu_products.override(choice)


def conv(x: jax.Array, kernel: jax.Array, strides: int, padding: int) -> jax.Array:
    """A square dense convolution, NHWC input, HWIO kernel. Non-overlapping windows (patch
    embeddings, 1x1 convs) are one matrix product of the reshaped patches on every backend:
    XLA:GPU takes the input gradient of a 16x16/16 patch embedding, which RSPC's corrupted
    images need, as a convolution over the 16x dilated gradient (22.8 of the 105 ms of
    DeiT-S's RSPC step, bfloat16, batch 256, one H200; the product is 30 GFLOP)."""
    if _non_overlapping(x, kernel.shape[0], strides, padding):
        return conv_patches(x, kernel)
    if not use_window_ops():
        return conv_reference(x, kernel, strides, padding)
    if x.shape[-1] < IMAGE_CHANNELS and kernel.shape[0] >= IMAGE_KERNEL:
        return conv_image(x, kernel, strides, padding)
    return conv_im2col(x, kernel, strides, padding)


def _non_overlapping(x: jax.Array, size: int, strides: int, padding: int) -> bool:
    return size == strides and padding == 0 and x.shape[1] % size == 0 and x.shape[2] % size == 0


def conv_patches(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """A conv whose windows tile the input (kernel size = stride, no padding): a reshape
    gathers the windows, one matrix product applies the kernel."""
    size = kernel.shape[0]
    batch, height, width, channels = x.shape
    patches = x.reshape(batch, height // size, size, width // size, size, channels)
    patches = patches.transpose(0, 1, 3, 2, 4, 5).reshape(
        batch, height // size, width // size, size * size * channels
    )
    return linear(patches, kernel.reshape(-1, kernel.shape[-1]))


def depthwise_conv(x: jax.Array, kernel: jax.Array, strides: int, padding: int) -> jax.Array:
    """A grouped convolution with one group per input channel (PyTorch groups=C_in)."""
    impl = depthwise_conv_shifted if use_window_ops() else grouped_conv_reference
    return impl(x, kernel, strides, padding)


def _windows(x: jax.Array, size: int, strides: int, padding: int, pad_value=0.0):
    """The size*size strided views of x (NHWC, or HWC: one image) whose elementwise
    combination is a size x size window op (conv, pooling), in kernel (row, column) order."""
    height = (x.shape[-3] + 2 * padding - size) // strides + 1
    width = (x.shape[-2] + 2 * padding - size) // strides + 1
    spatial = ((padding, padding), (padding, padding), (0, 0))
    x = jnp.pad(x, ((0, 0),) * (x.ndim - 3) + spatial, constant_values=pad_value)
    return [
        x[
            ...,
            i : i + strides * (height - 1) + 1 : strides,
            j : j + strides * (width - 1) + 1 : strides,
            :,
        ]
        for i in range(size)
        for j in range(size)
    ]


def conv_im2col(x: jax.Array, kernel: jax.Array, strides: int, padding: int) -> jax.Array:
    """A dense conv (kernel HWIO) as one matrix product over the gathered windows (im2col).

    Hand-written because XLA:CPU's convolutions are far slower than its matrix products
    (jax 0.10.2, 2-core CPU, forward+backward at batch 16: RVT's 7x7/2 stem conv 0.75 s =
    7 GFLOP/s; a 1x1 conv 192->768 97 ms, the same product as a matmul 35 ms)."""
    size = kernel.shape[0]
    if _non_overlapping(x, size, strides, padding):
        return conv_patches(x, kernel)
    patches = jnp.concatenate(_windows(x, size, strides, padding), axis=-1)
    return linear(patches, kernel.reshape(-1, kernel.shape[-1]))


# On CPU, kernels of at least IMAGE_KERNEL on inputs of fewer than IMAGE_CHANNELS channels
# (images) take `conv_image`; smaller kernels stay im2col, whose copy is then small.
IMAGE_CHANNELS, IMAGE_KERNEL = 4, 5


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def conv_image(x: jax.Array, kernel: jax.Array, strides: int, padding: int) -> jax.Array:
    """A large-kernel conv of an input with few channels (RVT's 7x7/2 RGB stem) on CPU.

    The forward is XLA's convolution of the input zero-padded to `IMAGE_CHANNELS` channels:
    Eigen's convolution runs 3 channels far slower than 4 (RVT's stem at batch 8: 45 against
    13 ms), and then beats im2col, which writes out a k*k-fold copy of the images (at 3x3,
    XCiT's stem, im2col stays faster). The kernel gradient is `_conv_kernel_gradient`'s
    products image by image. The images' gradient,
    which RSPC's corruption model needs, is the transpose of `conv_space_to_depth`: XLA's
    transposed convolution and im2col's k*k overlapping adds back into the images are both
    slower (docs/speed.md, "CPU: the stem on images (2026-12-01)")."""
    return _conv_channels_padded(x, kernel, strides, padding)


def _conv_channels_padded(x, kernel, strides, padding):
    extra = IMAGE_CHANNELS - x.shape[-1]
    x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, extra)))
    kernel = jnp.pad(kernel, ((0, 0), (0, 0), (0, extra), (0, 0)))
    return conv_reference(x, kernel, strides, padding)


def _conv_image_fwd(x, kernel, strides, padding):
    return conv_image(x, kernel, strides, padding), (x, kernel)


def _conv_image_bwd(strides, padding, residuals, grad):
    x, kernel = residuals
    # The images' gradient of each half of the batch on its own: where one half's is dropped
    # (RSPC's clean images, concatenated after the corrupted ones, take none), XLA removes
    # its computation (RVT-Ti*'s RSPC step at batch 8: 1.2 GFLOP and 54 MiB fewer;
    # docs/speed.md, "CPU: the images' gradient of the corrupted half only, and the pool's
    # index (2026-12-02)").
    parts = 2 if x.shape[0] % 2 == 0 else 1
    transpose = jax.linear_transpose(
        lambda x: conv_space_to_depth(x, kernel, strides, padding), x[: x.shape[0] // parts]
    )
    grad_x = jnp.concatenate([transpose(g)[0] for g in jnp.split(grad, parts)])
    return grad_x, _conv_kernel_gradient(x, grad, kernel.shape[0], strides, padding)


conv_image.defvjp(_conv_image_fwd, _conv_image_bwd)

# The most products `_conv_kernel_gradient` unrolls: larger batches take several images each.
_KERNEL_GRADIENT_PARTS = 16


def _conv_kernel_gradient(x, grad, size: int, strides: int, padding: int) -> jax.Array:
    """The kernel gradient of a conv on images: per image, its gathered windows (im2col)
    times its output gradient, summed over the images. XLA:CPU's own (a convolution with an
    output-sized window: 111 x 111 for RVT's stem) took 32-38 against 11-15 ms at batch 8,
    and im2col of the whole batch at once 30 ms. The windows are gathered kernel row by
    kernel row: one gather of all k*k windows per image took 3 times the compile memory
    (docs/speed.md, "CPU: the stem's kernel gradient, one image at a time (2026-12-02,
    Sapphire Rapids)")."""
    batch, features = grad.shape[0], grad.shape[-1]
    per_part = -(-batch // _KERNEL_GRADIENT_PARTS)
    parts = []
    for start in range(0, batch, per_part):
        # An image by its index: its gathers without a batch axis of one ran twice as fast.
        images = start if per_part == 1 else slice(start, start + per_part)
        windows = _windows(x[images], size, strides, padding)
        rows = [jnp.stack(windows[i * size : (i + 1) * size], -2) for i in range(size)]
        patches = jnp.stack(rows, -3).reshape(-1, size * size * x.shape[-1])
        # Summed in float32 whatever the compute dtype, as one convolution would accumulate.
        parts.append(
            jnp.matmul(
                patches.T, grad[images].reshape(-1, features), preferred_element_type=jnp.float32
            )
        )
    total = functools.reduce(jnp.add, parts)
    return total.reshape(size, size, x.shape[-1], features).astype(grad.dtype)


def conv_space_to_depth(x: jax.Array, kernel: jax.Array, strides: int, padding: int):
    """A strided conv as a stride-1 conv of the input's s x s blocks (s = strides): each
    output's window covers ceil(k / s) blocks a side, so with the kernel zero-padded to
    whole blocks it is, per row of blocks, one matrix product of contiguous block views.
    Its transpose (the input gradient) is then ceil(k / s)^2 shifted adds of whole blocks
    instead of k^2 strided ones."""
    size, s = kernel.shape[0], strides
    batch, height, width, channels = x.shape
    out_height = (height + 2 * padding - size) // s + 1
    out_width = (width + 2 * padding - size) // s + 1
    blocks = -(-size // s)
    used_height, used_width = (out_height - 1 + blocks) * s, (out_width - 1 + blocks) * s
    x = jnp.pad(
        x,
        (
            (0, 0),
            (padding, max(0, used_height - height - padding)),
            (padding, max(0, used_width - width - padding)),
            (0, 0),
        ),
    )[:, :used_height, :used_width]
    x = x.reshape(batch, used_height // s, s, used_width // s, s, channels)
    x = x.transpose(0, 1, 3, 2, 4, 5).reshape(batch, used_height // s, used_width // s, -1)
    kernel = jnp.pad(kernel, ((0, blocks * s - size), (0, blocks * s - size), (0, 0), (0, 0)))
    kernel = kernel.reshape(blocks, s, blocks, s, channels, -1).transpose(0, 2, 1, 3, 4, 5)
    kernel = kernel.reshape(blocks, blocks * s * s * channels, -1)
    rows = [
        jnp.concatenate([x[:, a : a + out_height, b : b + out_width] for b in range(blocks)], -1)
        @ kernel[a]
        for a in range(blocks)
    ]
    return functools.reduce(jnp.add, rows)


def conv_reference(x: jax.Array, kernel: jax.Array, strides: int, padding: int) -> jax.Array:
    """`conv_im2col` as XLA's convolution (what accelerators run)."""
    return jax.lax.conv_general_dilated(
        x,
        kernel,
        (strides, strides),
        ((padding, padding), (padding, padding)),
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )


def max_pool(x: jax.Array, size: int, strides: int, padding: int) -> jax.Array:
    """PyTorch MaxPool2d (padding counts as -inf)."""
    if not use_window_ops():
        return max_pool_reference(x, size, strides, padding)
    return max_pool_windows(x, size, strides, padding)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def max_pool_windows(x: jax.Array, size: int, strides: int, padding: int) -> jax.Array:
    """The maximum of the size*size strided views, with the gradient going to the first
    maximum of each window in row-major order, as PyTorch's does (a NaN counts as the
    maximum, so it propagates).

    The forward keeps one int8 index per output: autodiff of a chain of maxima kept a mask
    per view and added k*k zero-padded strided copies of the gradient back up. Here the
    gradient is laid out by blocks of strides x strides pixels, where each tap's part is a
    shift of whole blocks, and the blocks are put back in place once: RVT's stem pool
    (batch 8, 111x111x32) forward and backward took 3.7 against 37 ms; XLA:CPU's pooling
    gradient (select-and-scatter) took 35 ms (docs/speed.md, "CPU: the stem on images
    (2026-12-01)")."""
    return _max_and_index(x, size, strides, padding)[0]


def _max_and_index(x, size, strides, padding):
    """The windows' maxima and the tap of each window's first maximum (int8). The index is
    a reduction over the stacked views, which XLA writes out once: as a chain of
    elementwise selects, XLA:CPU fused it into the backward pass's block layout, which
    recomputed it for every tap that reads it (RVT-Ti*'s stem pool in the plain step at
    batch 8: 23.5 against 15.9 ms a step; docs/speed.md, "CPU: the images' gradient of the
    corrupted half only, and the pool's index (2026-12-02)")."""
    views = jnp.stack(_windows(x, size, strides, padding, -jnp.inf))
    index = jnp.argmax(views, axis=0).astype(jnp.int8)
    return jnp.max(views, axis=0), index


def _max_pool_windows_fwd(x, size, strides, padding):
    best, index = _max_and_index(x, size, strides, padding)
    return best, (index, x.shape)


def _max_pool_windows_bwd(size, strides, padding, residuals, grad):
    index, (batch, height, width, channels) = residuals
    out_height, out_width = grad.shape[1:3]
    blocks = -(-size // strides)
    block_rows, block_cols = out_height - 1 + blocks, out_width - 1 + blocks
    phases = []  # phase (p, q): the pixels at (p, q) within each block
    for p in range(strides):
        for q in range(strides):
            total = jnp.zeros((batch, block_rows, block_cols, channels), grad.dtype)
            for i in range(p, size, strides):
                for j in range(q, size, strides):
                    a, b = i // strides, j // strides
                    part = jnp.where(index == i * size + j, grad, 0)
                    pads = ((0, 0), (a, blocks - 1 - a), (b, blocks - 1 - b), (0, 0))
                    total = total + jnp.pad(part, pads)
            phases.append(total)
    padded = jnp.stack(phases, axis=3).reshape(
        batch, block_rows, block_cols, strides, strides, channels
    )
    padded = padded.transpose(0, 1, 3, 2, 4, 5).reshape(
        batch, block_rows * strides, block_cols * strides, channels
    )
    missing = (height + padding - padded.shape[1], width + padding - padded.shape[2])
    padded = jnp.pad(padded, ((0, 0), (0, max(0, missing[0])), (0, max(0, missing[1])), (0, 0)))
    return (padded[:, padding : padding + height, padding : padding + width],)


max_pool_windows.defvjp(_max_pool_windows_fwd, _max_pool_windows_bwd)


def max_pool_reference(x: jax.Array, size: int, strides: int, padding: int) -> jax.Array:
    """XLA's reduce-window max-pooling (what accelerators run)."""
    pad = ((padding, padding), (padding, padding))
    return nn.max_pool(x, (size, size), strides=(strides, strides), padding=pad)


def depthwise_conv_shifted(
    x: jax.Array, kernel: jax.Array, strides: int, padding: int
) -> jax.Array:
    """Grouped conv with one group per input channel (PyTorch groups=C_in), kernel
    (k, k, 1, C_in * m), NHWC: output channel o reads input channel o // m.

    Written as k*k shifted multiply-adds rather than `lax.conv(feature_group_count=C_in)`
    because XLA:CPU runs grouped convolutions, and far more their gradients, as generic
    loops: at RVT-Ti's MLP width (768 channels, 14x14, batch 16) the forward+backward took
    0.90 s as a grouped conv and 0.08 s as shifted products (jax 0.10.2, 2-core CPU).
    The sum is exact elementwise arithmetic, so the result matches the conv to rounding.
    """
    multiplier = kernel.shape[-1] // x.shape[-1]
    if multiplier > 1:
        x = jnp.repeat(x, multiplier, axis=-1)
    if strides == 1 and padding < kernel.shape[0]:
        return _depthwise_stride1(x, kernel[:, :, 0], padding)
    return _shifted_sum(x, kernel[:, :, 0], strides, padding)


def _shifted_sum(x: jax.Array, kernel: jax.Array, strides: int, padding: int) -> jax.Array:
    """sum over (i, j) of window (i, j) of x times kernel[i, j] (kernel (k, k, C))."""
    size = kernel.shape[0]
    windows = _windows(x, size, strides, padding)
    return functools.reduce(
        jnp.add, [w * kernel[i // size, i % size] for i, w in enumerate(windows)]
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _depthwise_stride1(x: jax.Array, kernel: jax.Array, padding: int) -> jax.Array:
    """`_shifted_sum` at stride 1 with a hand-written backward: autodiff would turn each of
    the k*k slices into a pad of the output gradient and add them up (k*k full-size
    passes; 0.39 s of RVT-Ti*'s 1.5 s step on 2 cores), while the input gradient is itself
    a stride-1 depthwise correlation with the flipped kernel, one fused shifted sum."""
    return _shifted_sum(x, kernel, 1, padding)


def _depthwise_stride1_fwd(x, kernel, padding):
    return _shifted_sum(x, kernel, 1, padding), (x, kernel)


def _depthwise_stride1_bwd(padding, residuals, grad):
    x, kernel = residuals
    size = kernel.shape[0]
    grad_x = _shifted_sum(grad, kernel[::-1, ::-1], 1, size - 1 - padding)
    grad_kernel = _depthwise_kernel_grad(x, grad, size, padding)
    return grad_x.astype(x.dtype), grad_kernel.astype(kernel.dtype)


_depthwise_stride1.defvjp(_depthwise_stride1_fwd, _depthwise_stride1_bwd)


def _depthwise_kernel_grad(x: jax.Array, grad: jax.Array, size: int, padding: int):
    """sum over (b, h, w) of window (i, j) of x times grad, for every (i, j): for each
    window, the part of the unpadded x that it overlaps times the matching part of grad
    (the padding adds zeros), summed over the images by `_sum_of_halves`, then over the
    positions.

    XLA:CPU fuses each window's slices, product and batch sum into one loop, so no window
    is written out: as zero-padded windows reduced by XLA's reduction, it wrote out k*k - 1
    windows of the whole batch first, and at RVT-Ti*'s RSPC size (16 x 14 x 14 x 768) the
    layer's input, gradient, padded copy and windows no longer fit the L3 cache: 19.5 ms a
    layer against 5 ms at 8 images, about half of what RSPC's step took beyond twice the
    plain step's (docs/speed.md, "CPU: the depthwise kernel gradient without windows
    (2026-12-01)")."""
    _, height, width, channels = x.shape
    out_height, out_width = grad.shape[1:3]
    sums = []
    for i in range(size):
        rows = _overlap(i, padding, height, out_height)
        for j in range(size):
            cols = _overlap(j, padding, width, out_width)
            x_part = x[
                :,
                rows[0] + i - padding : rows[1] + i - padding,
                cols[0] + j - padding : cols[1] + j - padding,
            ]
            grad_part = grad[:, rows[0] : rows[1], cols[0] : cols[1]]
            product = (x_part * grad_part).astype(jnp.float32)
            sums.append(jnp.sum(_sum_of_halves(product).reshape(-1, channels), axis=0))
    return jnp.stack(sums).reshape(size, size, channels).astype(x.dtype)


def _overlap(offset: int, padding: int, size: int, out_size: int) -> tuple[int, int]:
    """The output positions [start, stop) whose window tap `offset` reads the unpadded input
    (position p reads input p + offset - padding)."""
    return max(0, padding - offset), min(out_size, size + padding - offset)


def grouped_conv_reference(
    x: jax.Array, kernel: jax.Array, strides: int, padding: int
) -> jax.Array:
    """`depthwise_conv_shifted` as XLA's grouped convolution (what accelerators run)."""
    return jax.lax.conv_general_dilated(
        x,
        kernel,
        (strides, strides),
        ((padding, padding), (padding, padding)),
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        feature_group_count=x.shape[-1],
    )
