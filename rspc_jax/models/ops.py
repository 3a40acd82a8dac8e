"""The models' backend-specific ops behind one choice each, so the models and steps read the
same on every backend: window ops (dense and depthwise convolution, max-pooling), attention
whose maps are not needed (`use_fused_attention`), the gradient of a parameter shared by
every example (`broadcast_over_batch`), the backward pass of a dense layer's product
(`linear`), attention's batched products (`batched_matmul`), and XLA:CPU's instruction
schedule and matrix-product library for the jitted steps (`compiler_options`).

Each choice is made from the backend ('auto'): GPUs and TPUs run XLA's own ops, which their
compilers handle well; on CPU the models trace the forms of `cpu_ops`, which XLA:CPU runs
far faster. Both give the same numbers to float32 rounding (tests/test_layers.py).
`implementations(...)` picks a form explicitly while the models are traced and the steps
jitted: the benchmark's same-process A/B of a choice, the memory planner's accelerator
forms, and the tests of each form.
"""

from collections.abc import Iterator
import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp

from rspc_jax import ConfigError
from rspc_jax.models import cpu_ops

# choice -> ('auto', its own form, the plain XLA form): 'auto', the default, picks one of
# the two by the backend (`_auto`).
CHOICES = {
    "window_ops": ("auto", "windows", "xla"),
    "attention": ("auto", "fused", "explicit"),
    "batch_sum": ("auto", "pairwise", "xla"),
    "dense_gradient": ("auto", "layerwise", "xla"),
    "batched_gradient": ("auto", "untransposed", "xla"),
    "cpu_schedule": ("auto", "memory", "xla"),
    "cpu_products": ("auto", "onednn", "xla"),
}
# The choices made by the innermost `implementations` blocks; unset ones are 'auto'.
_chosen: dict[str, str] = {}
# The backend 'auto' decides for: `for_backend`'s, else JAX's default backend.
_target: list[str] = []


def check_choices(choices: dict[str, str]) -> None:
    """Refuses a choice or value that `CHOICES` does not list, naming the ones it does."""
    for name, value in choices.items():
        if name not in CHOICES:
            raise ConfigError(
                f"{name!r} is not an implementation choice of rspc_jax.models.ops: name one "
                f"of {', '.join(CHOICES)}"
            )
        if value not in CHOICES[name]:
            raise ConfigError(
                f"{name} value {value!r} is not one of {CHOICES[name]}: pass one of them"
            )


@contextlib.contextmanager
def implementations(**choices: str) -> Iterator[None]:
    """Traces the models and jits the steps with `choices` (e.g. batch_sum='xla') in the
    block, the other choices as they were."""
    check_choices(choices)
    previous = dict(_chosen)
    _chosen.update(choices)
    try:
        yield
    finally:
        _chosen.clear()
        _chosen.update(previous)


@contextlib.contextmanager
def for_backend(platform: str) -> Iterator[None]:
    """Traces the models and jits the steps in the block as for `platform` ('tpu', 'gpu',
    'cpu') whatever backend this process runs: the forms and compiler options 'auto' picks
    there, for compiling a TPU slice's step on a CPU host (`rspc_jax.tools.tpu_compile`)."""
    _target.append(platform)
    try:
        yield
    finally:
        _target.pop()


def _backend() -> str:
    return _target[-1] if _target else jax.default_backend()


def _on_cpu() -> bool:
    return _backend() == "cpu"


def _auto(name: str) -> bool:
    """Whether 'auto' picks the named choice's own form (not XLA's) on this backend."""
    if name == "attention":
        return _backend() == "gpu"
    if name == "cpu_products":
        return False
    if name == "batched_gradient":
        return _uses("cpu_products")
    return _on_cpu()


def _uses(name: str) -> bool:
    """Whether the named choice takes its own form (the second of `CHOICES`), chosen or by
    the backend; XLA:CPU's options (cpu_*) apply on CPU only."""
    if name.startswith("cpu_") and not _on_cpu():
        return False
    value = _chosen.get(name, "auto")
    return _auto(name) if value == "auto" else value == CHOICES[name][1]


def use_window_ops() -> bool:
    """Whether models trace the window forms of `cpu_ops` (CPU) rather than XLA's
    convolution and pooling."""
    return _uses("window_ops")


def use_fused_attention() -> bool:
    """Whether attention whose maps nobody reads is `jax.nn.dot_product_attention` (cuDNN's
    fused kernel on GPUs in 16-bit, `fused_attention_kernel`) rather than the explicit
    softmax of the logits: by default on GPUs only, as XLA:CPU runs it slower than the
    explicit form. The same values to float32 rounding (tests/test_layers.py)."""
    return _uses("attention")


def fused_attention_kernel(dtype) -> str:
    """`jax.nn.dot_product_attention`'s implementation for inputs of `dtype`: cuDNN's fused
    (flash) kernel on GPUs, which takes 16-bit inputs only; XLA's elsewhere. jax.nn's own
    default (None) is XLA's on every backend, so it must be asked for by name."""
    sixteen_bit = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "cudnn" if sixteen_bit and _backend() == "gpu" else "xla"


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


def broadcast_over_batch(x: jax.Array, batch: int) -> jax.Array:
    """`batch` copies of `x` along a new leading axis: a parameter that every example uses
    (RVT*'s PAAS mask). Its gradient is the sum over that axis, on CPU as pairwise sums of
    halves (`cpu_ops.broadcast_summed_pairwise`), elsewhere XLA's reduction. The same
    values to float32 rounding."""
    if _uses("batch_sum"):
        return cpu_ops.broadcast_summed_pairwise(x, batch)
    return jnp.broadcast_to(x, (batch,) + x.shape)


def linear(x: jax.Array, kernel: jax.Array, precision=None) -> jax.Array:
    """x (..., in) @ kernel (in, out), a dense layer's product (`layers.dense`, 1x1 and
    patch convolutions). On CPU its backward pass is `cpu_ops.linear_layerwise`'s, elsewhere
    autodiff's. The same values to float32 rounding (tests/test_layers.py)."""
    if _uses("dense_gradient"):
        return cpu_ops.linear_layerwise(x, kernel, precision)
    return jax.lax.dot_general(x, kernel, cpu_ops.dense_dimensions(x.ndim), precision=precision)


def dense_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """`nn.Dense`'s `dot_general` argument: its product as `linear`."""
    if (
        dimension_numbers != cpu_ops.dense_dimensions(lhs.ndim)
        or preferred_element_type is not None
    ):
        raise ValueError(
            f"dense_dot_general takes nn.Dense's product only (contracting the input's last "
            f"axis with the kernel's first, no preferred element type), not "
            f"{dimension_numbers} with {preferred_element_type}: call jax.lax.dot_general"
        )
    return linear(lhs, rhs, precision)


def batched_matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """a (..., m, k) @ b (..., k, n) over leading batch axes: attention's two products.
    With oneDNN's products on CPU (`compiler_options`) the gradient of b is
    `cpu_ops.batched_matmul_untransposed`'s, whose products have no transposed operand;
    elsewhere autodiff's. The same values to float32 rounding (tests/test_layers.py)."""
    if _uses("batched_gradient"):
        return cpu_ops.batched_matmul_untransposed(a, b)
    return jnp.matmul(a, b)


def compiler_options() -> dict[str, str | bool] | None:
    """XLA options for jitting the train and eval steps, read when they are jitted: None
    except on CPU, where two choices apply.
    - `cpu_schedule`: the memory-optimized instruction schedule. XLA:CPU's default orders
      independent ops so that its threads can run them concurrently, which keeps their
      buffers alive together; the memory schedule cuts the steps' temporaries and runs
      them as fast or faster on few cores. Scheduling changes no value.
    - `cpu_products`: jaxlib's default products unless 'onednn' is chosen. oneDNN's
      products (each product alone; the fused form crashes on RVT*'s attention) run a
      batched product on all cores where jaxlib's default runs it on one, but XLA:CPU's
      oneDNN thunk returns its runtime to a pool only after the run's completion can free
      the executable: a program released while its last run finishes aborts the process
      (`ObjectPool` check) or hangs (docs/faults.md, 'A CPU process aborts in oneDNN').
      Hence opt-in only, e.g. for a benchmark that keeps its steps alive. Not storable in
      JAX's persistent compilation cache either."""
    if not _on_cpu():
        return None
    options = {}
    if _uses("cpu_schedule"):
        options["xla_cpu_scheduler_type"] = "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"
    if _uses("cpu_products"):
        options["xla_cpu_use_onednn"] = True
        options["xla_cpu_experimental_onednn_fusion_type"] = "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"
    return options or None


def conv(x: jax.Array, kernel: jax.Array, strides: int, padding: int) -> jax.Array:
    """A square dense convolution, NHWC input, HWIO kernel. Non-overlapping windows (patch
    embeddings, 1x1 convs) are one matrix product of the reshaped patches on every backend:
    XLA:GPU takes the input gradient of a patch embedding, which RSPC's corrupted images
    need, as a convolution over the dilated gradient, far slower than the product."""
    if _non_overlapping(x, kernel.shape[0], strides, padding):
        return conv_patches(x, kernel)
    if not use_window_ops():
        return conv_reference(x, kernel, strides, padding)
    if x.shape[-1] < cpu_ops.IMAGE_CHANNELS and kernel.shape[0] >= cpu_ops.IMAGE_KERNEL:
        return cpu_ops.conv_image(x, kernel, strides, padding)
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


def conv_im2col(x: jax.Array, kernel: jax.Array, strides: int, padding: int) -> jax.Array:
    """A dense conv (kernel HWIO) as one matrix product over the gathered windows (im2col),
    CPU's form of the convolutions that are not `cpu_ops.conv_image`'s: XLA:CPU's
    convolutions are far slower than its matrix products."""
    size = kernel.shape[0]
    if _non_overlapping(x, size, strides, padding):
        return conv_patches(x, kernel)
    patches = jnp.concatenate(cpu_ops.windows(x, size, strides, padding), axis=-1)
    return linear(patches, kernel.reshape(-1, kernel.shape[-1]))


def conv_reference(x: jax.Array, kernel: jax.Array, strides: int, padding: int) -> jax.Array:
    """`conv_im2col` as XLA's convolution (what accelerators run)."""
    return jax.lax.conv_general_dilated(
        x,
        kernel,
        (strides, strides),
        ((padding, padding), (padding, padding)),
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )


def depthwise_conv(x: jax.Array, kernel: jax.Array, strides: int, padding: int) -> jax.Array:
    """A grouped convolution with one group per input channel (PyTorch groups=C_in)."""
    impl = cpu_ops.depthwise_conv_shifted if use_window_ops() else grouped_conv_reference
    return impl(x, kernel, strides, padding)


def grouped_conv_reference(
    x: jax.Array, kernel: jax.Array, strides: int, padding: int
) -> jax.Array:
    """`cpu_ops.depthwise_conv_shifted` as XLA's grouped convolution (what accelerators
    run)."""
    return jax.lax.conv_general_dilated(
        x,
        kernel,
        (strides, strides),
        ((padding, padding), (padding, padding)),
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        feature_group_count=x.shape[-1],
    )


def max_pool(x: jax.Array, size: int, strides: int, padding: int) -> jax.Array:
    """PyTorch MaxPool2d (padding counts as -inf)."""
    if not use_window_ops():
        return max_pool_reference(x, size, strides, padding)
    return cpu_ops.max_pool_windows(x, size, strides, padding)


def max_pool_reference(x: jax.Array, size: int, strides: int, padding: int) -> jax.Array:
    """XLA's reduce-window max-pooling (what accelerators run)."""
    pad = ((padding, padding), (padding, padding))
    return nn.max_pool(x, (size, size), strides=(strides, strides), padding=pad)
