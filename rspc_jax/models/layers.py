"""Building blocks shared by the transformer models (timm semantics, PyTorch names)."""

import functools
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

# PyTorch's nn.GELU is the exact erf form; flax's default is the tanh approximation.
gelu = functools.partial(nn.gelu, approximate=False)

# timm initialises Linear layers with trunc-normal(0.02) and zero bias.
dense_init = nn.initializers.truncated_normal(stddev=0.02)


def torch_default_uniform(fan_in: int):
    """PyTorch's default Linear/Conv init (kaiming-uniform, a=sqrt(5)): U(-1/sqrt(fan_in), +)."""
    bound = 1.0 / jnp.sqrt(fan_in)
    return lambda key, shape, dtype=jnp.float32: jax.random.uniform(
        key, shape, dtype, -bound, bound)


def linear_init(fan_in: int, torch_init: bool) -> dict:
    """Dense/Conv initialiser kwargs: timm's (trunc-normal(0.02), zero bias) or PyTorch's
    defaults for kernel and bias (models such as RVT that never re-initialise them)."""
    if not torch_init:
        return {"kernel_init": dense_init}
    init = torch_default_uniform(fan_in)
    return {"kernel_init": init, "bias_init": init}


def batch_norm(train: bool, axis_name: Optional[str], name: str) -> nn.BatchNorm:
    """PyTorch BatchNorm2d defaults (momentum 0.1, eps 1e-5) in flax's convention."""
    return nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5,
                        axis_name=axis_name, name=name)


def _on_cpu() -> bool:
    return jax.default_backend() == "cpu"


def _windows(x: jax.Array, size: int, strides: int, padding: int, pad_value=0.0):
    """The size*size strided views of x (NHWC) whose elementwise combination is a
    size x size window op (conv, pooling), in kernel (row, column) order."""
    height = (x.shape[1] + 2 * padding - size) // strides + 1
    width = (x.shape[2] + 2 * padding - size) // strides + 1
    x = jnp.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)),
                constant_values=pad_value)
    return [x[:, i:i + strides * (height - 1) + 1:strides, j:j + strides * (width - 1) + 1:strides]
            for i in range(size) for j in range(size)]


def conv_as_matmul(x: jax.Array, kernel: jax.Array, strides: int, padding: int) -> jax.Array:
    """A dense conv (kernel HWIO) as one matrix product over the gathered windows (im2col).

    Hand-written because XLA:CPU's convolutions are far slower than its matrix products
    (jax 0.10.2, 2-core CPU, forward+backward at batch 16: RVT's 7x7/2 stem conv 0.75 s =
    7 GFLOP/s; a 1x1 conv 192->768 97 ms, the same product as a matmul 35 ms)."""
    size = kernel.shape[0]
    batch, height, width, channels = x.shape
    if size == strides and padding == 0 and height % size == 0 and width % size == 0:
        # Non-overlapping windows (patch embeddings, 1x1 convs): a reshape gathers them.
        patches = x.reshape(batch, height // size, size, width // size, size, channels)
        patches = patches.transpose(0, 1, 3, 2, 4, 5).reshape(
            batch, height // size, width // size, size * size * channels)
    else:
        patches = jnp.concatenate(_windows(x, size, strides, padding), axis=-1)
    return patches @ kernel.reshape(-1, kernel.shape[-1])


def conv_reference(x: jax.Array, kernel: jax.Array, strides: int, padding: int) -> jax.Array:
    """`conv_as_matmul` as XLA's convolution (what accelerators run)."""
    return jax.lax.conv_general_dilated(
        x, kernel, (strides, strides), ((padding, padding), (padding, padding)),
        dimension_numbers=("NHWC", "HWIO", "NHWC"))


class Conv(nn.Module):
    """Drop-in for a square `nn.Conv(features, (k, k), strides, padding=p)` with the same
    parameters: `conv_as_matmul` on CPU, XLA's convolution on GPUs/TPUs."""

    features: int
    kernel_size: int
    strides: int = 1
    padding: int = 0
    use_bias: bool = True
    kernel_init: Callable = nn.initializers.lecun_normal()
    bias_init: Callable = nn.initializers.zeros

    @nn.compact
    def __call__(self, x):
        size = self.kernel_size
        kernel = self.param("kernel", self.kernel_init, (size, size, x.shape[-1], self.features))
        bias = self.param("bias", self.bias_init, (self.features,)) if self.use_bias else None
        x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias)
        conv = conv_as_matmul if _on_cpu() else conv_reference
        y = conv(x, kernel, self.strides, self.padding)
        return y if bias is None else y + bias


def max_pool(x: jax.Array, size: int, strides: int, padding: int) -> jax.Array:
    """PyTorch MaxPool2d (padding counts as -inf). On CPU the maximum of the size*size
    strided views, since XLA:CPU's pooling gradient (select-and-scatter) took 0.18 s at
    RVT's stem size (batch 16, 111x111x32); a tie inside a window then shares the gradient
    equally instead of giving it to one element (ties do not occur in real feature maps)."""
    if not _on_cpu():
        pad = ((padding, padding), (padding, padding))
        return nn.max_pool(x, (size, size), strides=(strides, strides), padding=pad)
    return functools.reduce(jnp.maximum, _windows(x, size, strides, padding, -jnp.inf))


def depthwise_conv(x: jax.Array, kernel: jax.Array, strides: int, padding: int) -> jax.Array:
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
    size = kernel.shape[0]
    windows = _windows(x, size, strides, padding)
    return functools.reduce(jnp.add, [w * kernel[i // size, i % size, 0]
                                      for i, w in enumerate(windows)])


def grouped_conv_reference(x: jax.Array, kernel: jax.Array, strides: int,
                           padding: int) -> jax.Array:
    """`depthwise_conv` as XLA's grouped convolution (what accelerators run)."""
    return jax.lax.conv_general_dilated(
        x, kernel, (strides, strides), ((padding, padding), (padding, padding)),
        dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=x.shape[-1])


class DepthwiseConv(nn.Module):
    """Drop-in for `nn.Conv(features, (k, k), feature_group_count=C_in, padding=p)`: the
    same parameters (kernel (k, k, 1, features), bias), so checkpoints and the PyTorch
    layout are unchanged. On CPU it computes `depthwise_conv` (shifted products); on
    GPUs/TPUs XLA's grouped convolution, which their compilers run well."""

    features: int
    kernel_size: int
    strides: int = 1
    padding: int = 0
    kernel_init: Callable = nn.initializers.lecun_normal()
    bias_init: Callable = nn.initializers.zeros

    @nn.compact
    def __call__(self, x):
        channels = x.shape[-1]
        if self.features % channels:
            raise ValueError(f"a depthwise conv needs output channels ({self.features}) that "
                             f"are a multiple of its input channels ({channels})")
        kernel = self.param("kernel", self.kernel_init,
                            (self.kernel_size, self.kernel_size, 1, self.features))
        bias = self.param("bias", self.bias_init, (self.features,))
        x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias)
        conv = depthwise_conv if _on_cpu() else grouped_conv_reference
        return conv(x, kernel, self.strides, self.padding) + bias


class DropPath(nn.Module):
    """Per-sample stochastic depth (timm `DropPath`): drops the whole residual branch."""

    rate: float  # or a traced scalar (a scanned block's rate)

    @nn.compact
    def __call__(self, x, *, train: bool):
        if not train or (isinstance(self.rate, float) and self.rate == 0.0):
            return x
        keep = 1.0 - self.rate
        shape = (x.shape[0],) + (1,) * (x.ndim - 1)
        mask = jax.random.bernoulli(self.make_rng("dropout"), keep, shape)
        return jnp.where(mask, x / keep, 0.0).astype(x.dtype)


class Mlp(nn.Module):
    hidden_dim: int
    dropout: float = 0.0
    torch_init: bool = False

    @nn.compact
    def __call__(self, x, *, train: bool):
        out_dim = x.shape[-1]
        x = nn.Dense(self.hidden_dim, **linear_init(out_dim, self.torch_init), name="fc1")(x)
        x = gelu(x)
        x = nn.Dropout(self.dropout, deterministic=not train)(x)
        x = nn.Dense(out_dim, **linear_init(self.hidden_dim, self.torch_init), name="fc2")(x)
        return nn.Dropout(self.dropout, deterministic=not train)(x)


class Attention(nn.Module):
    """Multi-head self-attention with a fused qkv projection (timm/RVT layout [q; k; v]).

    Returns the output and the post-softmax attention map (B, heads, N, N).
    `paas` adds RVT*'s position-aware attention scaling: a learned `att_mask` (heads, N, N)
    whose sigmoid multiplies the scaled logits before the softmax. `bias` (N, N) is added
    to the logits before the softmax (-inf-like entries forbid pairs; `interventions`).
    `key_keep` (B, N) multiplies each key's attention weight, renormalised over the keys:
    with 0/1 values, exactly attention over the kept tokens only (RSPC's token-dropping
    ablation), differentiable in the multipliers. N is the token count at
    init, so the parameters then fit that input size only (`interop` can interpolate them).
    """

    num_heads: int
    qkv_bias: bool = True
    dropout: float = 0.0
    paas: bool = False
    torch_init: bool = False

    @nn.compact
    def __call__(self, x, *, train: bool, bias: Optional[jax.Array] = None,
                 key_keep: Optional[jax.Array] = None):
        batch, tokens, dim = x.shape
        if dim % self.num_heads:
            raise ValueError(f"width {dim} is not divisible by num_heads {self.num_heads}")
        head_dim = dim // self.num_heads
        init = linear_init(dim, self.torch_init)
        qkv = nn.Dense(3 * dim, use_bias=self.qkv_bias, **init, name="qkv")(x)
        qkv = qkv.reshape(batch, tokens, 3, self.num_heads, head_dim)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * head_dim**-0.5
        if self.paas:
            logits = logits * jax.nn.sigmoid(self._att_mask(tokens)).astype(logits.dtype)
        if bias is not None:
            logits = logits + bias.astype(logits.dtype)
        attn = _softmax(logits.astype(jnp.float32), key_keep).astype(x.dtype)
        attn_dropped = nn.Dropout(self.dropout, deterministic=not train)(attn)
        out = jnp.einsum("bhqk,bkhd->bqhd", attn_dropped, v).reshape(batch, tokens, dim)
        out = nn.Dense(dim, **init, name="proj")(out)
        return nn.Dropout(self.dropout, deterministic=not train)(out), attn

    def _att_mask(self, tokens: int) -> jax.Array:
        shape = (self.num_heads, tokens, tokens)
        if self.has_variable("params", "att_mask"):
            trained = self.get_variable("params", "att_mask").shape
            if trained != shape:
                raise ValueError(
                    f"PAAS att_mask {trained} was made for {trained[-1]} tokens, the input has "
                    f"{tokens}: feed the image size it was trained at, or load the weights with "
                    f"interpolated masks (config.init_resize=True, rspc_jax.interop)")
        return self.param("att_mask", dense_init, shape)


def _softmax(logits: jax.Array, key_keep: Optional[jax.Array]) -> jax.Array:
    """Softmax over keys, each key's weight multiplied by key_keep (B, N) and renormalised.
    The shift is the largest kept logit and dropped logits never reach exp, so a dropped
    key however large can neither overflow nor underflow the kept ones."""
    if key_keep is None:
        return jax.nn.softmax(logits, axis=-1)
    keep = key_keep[:, None, None, :].astype(logits.dtype)
    top = jax.lax.stop_gradient(jnp.where(keep > 0, logits, -jnp.inf).max(axis=-1, keepdims=True))
    weights = jnp.exp(jnp.where(keep > 0, logits, top) - top) * keep
    return weights / weights.sum(axis=-1, keepdims=True)


class Block(nn.Module):
    """Pre-norm transformer block: x += attn(norm1(x)); x += mlp(norm2(x))."""

    num_heads: int
    mlp_dim: int
    drop_path: float = 0.0
    dropout: float = 0.0
    layernorm_eps: float = 1e-6

    @nn.compact
    def __call__(self, x, train: bool, key_keep: Optional[jax.Array] = None):
        drop_path = DropPath(self.drop_path)
        y, attn = Attention(self.num_heads, dropout=self.dropout, name="attn")(
            nn.LayerNorm(epsilon=self.layernorm_eps, name="norm1")(x), train=train,
            key_keep=key_keep)
        x = x + drop_path(y, train=train)
        y = Mlp(self.mlp_dim, dropout=self.dropout, name="mlp")(
            nn.LayerNorm(epsilon=self.layernorm_eps, name="norm2")(x), train=train)
        x = x + drop_path(y, train=train)
        return x, attn


def sow_block(module: nn.Module, x: jax.Array, attn: Optional[jax.Array], sow_attention: bool):
    """Records a block's output (and attention on request) under the model's intermediates."""
    module.sow("intermediates", "block_outputs", x)
    if sow_attention and attn is not None:
        module.sow("intermediates", "attention_maps", attn)


def sow_class_attention(module: nn.Module, attn: jax.Array, sow_attention: bool):
    """Records a class-attention block's class-token row (B, heads, 1, N + 1) on request,
    apart from the backbone blocks' maps so that those stay aligned with block_outputs."""
    if sow_attention:
        module.sow("intermediates", "class_attention_maps", attn)


def drop_path_rates(rate: float, depth: int, endpoint: bool = True) -> list[float]:
    """Linearly increasing stochastic-depth rates from 0: up to `rate` (timm/DeiT), or
    with `endpoint=False` rate * i / depth, never reaching `rate` (RVT)."""
    if not endpoint:
        return [rate * i / depth for i in range(depth)]
    if depth == 1:
        return [0.0]
    return [rate * i / (depth - 1) for i in range(depth)]


def maybe_remat(block_class: type, remat: bool, static_argnums: tuple[int, ...]) -> type:
    """`block_class`, or its `nn.remat` (activations recomputed in the backward pass: less
    memory for about a third more compute). Flax traces keyword arguments, so static
    arguments (the train flag, the token grid) go positionally; argnum 0 is the module."""
    return nn.remat(block_class, static_argnums=static_argnums) if remat else block_class
