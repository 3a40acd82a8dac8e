"""The CPU forms of the models' ops, which `ops` traces on CPU (`ops.implementations`).

XLA:CPU runs convolutions, grouped convolutions, the pooling gradient, reductions over a
leading axis and products with a transposed operand far slower than matrix products and
elementwise ops, so on CPU these ops are written as gathered windows (im2col products,
shifted multiply-adds, a maximum of shifted views, XLA's conv on a fourth zero channel for
a large kernel on images), pairwise sums and untransposed products, several with a
hand-written backward pass. Each gives the same values and gradients as the XLA op that
GPUs and TPUs run, to float32 rounding (tests/test_layers.py).
"""

import functools

import jax
import jax.numpy as jnp


def _xla_conv(x: jax.Array, kernel: jax.Array, strides: int, padding: int) -> jax.Array:
    """XLA's dense convolution, NHWC input, HWIO kernel (`conv_image`'s forward)."""
    return jax.lax.conv_general_dilated(
        x,
        kernel,
        (strides, strides),
        ((padding, padding), (padding, padding)),
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def broadcast_summed_pairwise(x: jax.Array, batch: int) -> jax.Array:
    """`batch` copies of `x` along a new leading axis, whose gradient (the sum over that
    axis) is `_sum_of_halves`: XLA:CPU runs its reduction over a leading axis of large
    arrays many times slower than the same adds as elementwise sums."""
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


broadcast_summed_pairwise.defvjp(_broadcast_summed_pairwise_fwd, _broadcast_summed_pairwise_bwd)


def dense_dimensions(ndim: int):
    """`jax.lax.dot_general`'s dimensions of a dense layer's product: the input's last axis
    with the kernel's first."""
    return ((ndim - 1,), (0,)), ((), ())


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def linear_layerwise(x: jax.Array, kernel: jax.Array, precision) -> jax.Array:
    """`ops.linear` with a backward pass written for XLA:CPU. Two things differ from
    autodiff's, neither a value:
    - The kernel's gradient contracts the tokens of the input and of the output's gradient.
      XLA:CPU wrote it as a product with both operands transposed, which it hands to
      Eigen, after copying the output's gradient into a transposed layout. Here the
      narrower operand is transposed behind an optimization barrier (so XLA cannot fold the
      transpose back) and the product is an untransposed one, which XLA gives YNNPACK.
    - The input's gradient is made to depend on the kernel's (plus 0 x its sum, which XLA
      does not fold away), so the memory-optimized schedule computes each layer's kernel
      gradient before it moves on to the layer below, and frees that layer's input and
      output gradient. Autodiff leaves the kernel gradients free to wait, and the
      schedule kept them, and the activations they read, for the end of the backward
      pass. A non-finite kernel gradient makes
      the input's non-finite too; where the kernel takes no gradient (an attack's input
      gradient) none is computed."""
    return jax.lax.dot_general(x, kernel, dense_dimensions(x.ndim), precision=precision)


def _linear_layerwise_fwd(x, kernel, precision):
    """Keeps only what the gradients asked for need: no input where the kernel takes no
    gradient (an attack's input gradient), no kernel where the input takes none."""
    y = jax.lax.dot_general(
        x.value, kernel.value, dense_dimensions(x.value.ndim), precision=precision
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


linear_layerwise.defvjp(_linear_layerwise_fwd, _linear_layerwise_bwd, symbolic_zeros=True)


def _transposed_product(a: jax.Array, b: jax.Array, precision=None) -> jax.Array:
    """a^T @ b over any leading batch axes (contracting the second-to-last axis of both)
    as a product of untransposed operands: the narrower one is transposed behind an
    optimization barrier, and the result stays behind one, so that XLA cannot fold the
    transposes back into a product with a transposed operand, which XLA:CPU runs slower
    (Eigen's under jaxlib's default products, oneDNN's batched ones too)."""
    barrier = jax.lax.optimization_barrier
    swap = functools.partial(jnp.swapaxes, axis1=-1, axis2=-2)
    if a.shape[-1] <= b.shape[-1]:
        return barrier(jnp.matmul(barrier(swap(a)), b, precision=precision))
    # the transposed product, whose own transpose is a copy of the small result
    return swap(barrier(jnp.matmul(barrier(swap(b)), a, precision=precision)))


@jax.custom_vjp
def batched_matmul_untransposed(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b over leading batch axes, whose gradient of b is `_transposed_product`'s, a
    product of untransposed operands: autodiff's contracts the tokens of a and of the
    output's gradient, a product with a transposed operand, which oneDNN runs slower."""
    return jnp.matmul(a, b)


def _batched_matmul_untransposed_fwd(a, b):
    return jnp.matmul(a, b), (a, b)


def _batched_matmul_untransposed_bwd(residuals, grad):
    a, b = residuals
    return jnp.matmul(grad, jnp.swapaxes(b, -1, -2)), _transposed_product(a, grad)


batched_matmul_untransposed.defvjp(
    _batched_matmul_untransposed_fwd, _batched_matmul_untransposed_bwd
)


def windows(x: jax.Array, size: int, strides: int, padding: int, pad_value=0.0):
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


# On CPU, kernels of at least IMAGE_KERNEL on inputs of fewer than IMAGE_CHANNELS channels
# (images) take `conv_image`; smaller kernels stay im2col, whose copy is then small.
IMAGE_CHANNELS, IMAGE_KERNEL = 4, 5


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def conv_image(x: jax.Array, kernel: jax.Array, strides: int, padding: int) -> jax.Array:
    """A large-kernel conv of an input with few channels (RVT's 7x7/2 RGB stem) on CPU.

    The forward is XLA's convolution of the input zero-padded to `IMAGE_CHANNELS` channels:
    Eigen's convolution runs 3 channels far slower than 4, and then beats im2col, which
    writes out a k*k-fold copy of the images (at 3x3, XCiT's stem, im2col stays faster).
    The kernel gradient is `_conv_kernel_gradient`'s products image by image. The images'
    gradient, which RSPC's corruption model needs, is the transpose of
    `conv_space_to_depth`: XLA's transposed convolution and im2col's k*k overlapping adds
    back into the images are both slower."""
    return _conv_channels_padded(x, kernel, strides, padding)


def _conv_channels_padded(x, kernel, strides, padding):
    extra = IMAGE_CHANNELS - x.shape[-1]
    x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, extra)))
    kernel = jnp.pad(kernel, ((0, 0), (0, 0), (0, extra), (0, 0)))
    return _xla_conv(x, kernel, strides, padding)


def _conv_image_fwd(x, kernel, strides, padding):
    return conv_image(x, kernel, strides, padding), (x, kernel)


def _conv_image_bwd(strides, padding, residuals, grad):
    x, kernel = residuals
    # The images' gradient of each half of the batch on its own: where one half's is dropped
    # (RSPC's clean images, concatenated after the corrupted ones, take none), XLA removes
    # its computation.
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
    times its output gradient, summed over the images: XLA:CPU's own (a convolution with an
    output-sized window) and im2col of the whole batch at once are both slower. The
    windows are gathered kernel row by kernel row: one gather of all k*k windows per image
    takes several times the compile memory."""
    batch, features = grad.shape[0], grad.shape[-1]
    per_part = -(-batch // _KERNEL_GRADIENT_PARTS)
    parts = []
    for start in range(0, batch, per_part):
        # An image by its index: gathers without a batch axis of one run faster.
        images = start if per_part == 1 else slice(start, start + per_part)
        views = windows(x[images], size, strides, padding)
        rows = [jnp.stack(views[i * size : (i + 1) * size], -2) for i in range(size)]
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def max_pool_windows(x: jax.Array, size: int, strides: int, padding: int) -> jax.Array:
    """The maximum of the size*size strided views, with the gradient going to the first
    maximum of each window in row-major order, as PyTorch's does (a NaN counts as the
    maximum, so it propagates).

    The forward keeps one int8 index per output: autodiff of a chain of maxima kept a mask
    per view and added k*k zero-padded strided copies of the gradient back up. Here the
    gradient is laid out by blocks of strides x strides pixels, where each tap's part is a
    shift of whole blocks, and the blocks are put back in place once, several times faster
    than both autodiff's and XLA:CPU's pooling gradient (select-and-scatter)."""
    return _max_and_index(x, size, strides, padding)[0]


def _max_and_index(x, size, strides, padding):
    """The windows' maxima and the tap of each window's first maximum (int8). The index is
    a reduction over the stacked views, which XLA writes out once: as a chain of
    elementwise selects, XLA:CPU fused it into the backward pass's block layout, which
    recomputed it for every tap that reads it."""
    views = jnp.stack(windows(x, size, strides, padding, -jnp.inf))
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


def depthwise_conv_shifted(
    x: jax.Array, kernel: jax.Array, strides: int, padding: int
) -> jax.Array:
    """Grouped conv with one group per input channel (PyTorch groups=C_in), kernel
    (k, k, 1, C_in * m), NHWC: output channel o reads input channel o // m.

    Written as k*k shifted multiply-adds rather than `lax.conv(feature_group_count=C_in)`
    because XLA:CPU runs grouped convolutions, and far more their gradients, as generic
    loops, an order of magnitude slower than the shifted products. The sum is exact
    elementwise arithmetic, so the result matches the conv to rounding.
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
    views = windows(x, size, strides, padding)
    return functools.reduce(jnp.add, [w * kernel[i // size, i % size] for i, w in enumerate(views)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _depthwise_stride1(x: jax.Array, kernel: jax.Array, padding: int) -> jax.Array:
    """`_shifted_sum` at stride 1 with a hand-written backward: autodiff would turn each of
    the k*k slices into a pad of the output gradient and add them up (k*k full-size
    passes), while the input gradient is itself
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
    windows of the whole batch first, and at RSPC's doubled batch the layer's input,
    gradient, padded copy and windows no longer fit the cache."""
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
