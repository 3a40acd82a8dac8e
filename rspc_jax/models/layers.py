"""Building blocks shared by the transformer models (timm semantics, PyTorch names)."""

from collections.abc import Callable
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from rspc_jax.models import ops

_SQRT_HALF = 0.7071067811865476


@jax.custom_vjp
def gelu(x: jax.Array) -> jax.Array:
    """Exact GELU, 0.5 x (1 + erf(x / sqrt 2)): PyTorch's nn.GELU (flax's default is the tanh
    approximation). Written with erf as PyTorch does: `nn.gelu(approximate=False)` uses
    erfc, which XLA:CPU evaluates several times slower, for the same values to 1e-6. The
    backward pass keeps the input only, as PyTorch's does (`_gelu_bwd`)."""
    return 0.5 * x * (1.0 + jax.lax.erf(x * jnp.asarray(_SQRT_HALF, x.dtype)))


def _gelu_fwd(x):
    return gelu(x), x


def _gelu_bwd(x, grad):
    """Recomputes the normal CDF from the input. Autodiff of `gelu` kept the forward's erf:
    one more array of the MLP's hidden width per layer in the train step's memory. The CDF
    is written with erf's symmetry, 1 - erf(-x / sqrt 2), so that XLA does not merge it
    with the forward's erf and keep that after all (as it did with x / sqrt 2, which it
    turns into the forward's product)."""
    cdf = 0.5 * (1.0 - jax.lax.erf(x * jnp.asarray(-_SQRT_HALF, x.dtype)))
    density = jnp.exp(-0.5 * x * x) * jnp.asarray((2 * math.pi) ** -0.5, x.dtype)
    return (grad * (cdf + x * density),)


gelu.defvjp(_gelu_fwd, _gelu_bwd)


def softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    """`jax.nn.softmax` with JAX's newer derivative (`jax.softmax_custom_jvp`, not yet its
    default), which reads the output only. The default differentiates exp(x - max) / sum,
    so every attention layer kept both its exponentials and its map for the backward pass:
    one attention map more per layer in the train step's memory. The same values to float32
    rounding."""
    with jax.softmax_custom_jvp(True):
        return jax.nn.softmax(x, axis=axis)


# timm initialises Linear layers with trunc-normal(0.02) and zero bias.
dense_init = nn.initializers.truncated_normal(stddev=0.02)


def torch_default_uniform(fan_in: int):
    """PyTorch's default Linear/Conv init (kaiming-uniform, a=sqrt(5)): U(-1/sqrt(fan_in), +)."""
    bound = 1.0 / jnp.sqrt(fan_in)
    return lambda key, shape, dtype=jnp.float32: jax.random.uniform(
        key, shape, dtype, -bound, bound
    )


def linear_init(fan_in: int, torch_init: bool) -> dict:
    """Dense/Conv initialiser kwargs: timm's (trunc-normal(0.02), zero bias) or PyTorch's
    defaults for kernel and bias (models such as RVT that never re-initialise them)."""
    if not torch_init:
        return {"kernel_init": dense_init}
    init = torch_default_uniform(fan_in)
    return {"kernel_init": init, "bias_init": init}


def dense(features: int, **kwargs) -> nn.Dense:
    """`nn.Dense` (the same parameters) whose product is `ops.linear`, with the backend's
    backward pass."""
    return nn.Dense(features, dot_general=ops.dense_dot_general, **kwargs)


def batch_norm(train: bool, axis_name: str | None, name: str) -> nn.BatchNorm:
    """PyTorch BatchNorm2d defaults (momentum 0.1, eps 1e-5) in flax's convention."""
    return nn.BatchNorm(
        use_running_average=not train, momentum=0.9, epsilon=1e-5, axis_name=axis_name, name=name
    )


class Conv(nn.Module):
    """Drop-in for a square `nn.Conv(features, (k, k), strides, padding=p)` with the same
    parameters, computed by `ops.conv` (the backend's faster implementation)."""

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
        y = ops.conv(x, kernel, self.strides, self.padding)
        return y if bias is None else y + bias


class DepthwiseConv(nn.Module):
    """Drop-in for `nn.Conv(features, (k, k), feature_group_count=C_in, padding=p)`: the
    same parameters (kernel (k, k, 1, features), bias), so checkpoints and the PyTorch
    layout are unchanged. Computed by `ops.depthwise_conv`."""

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
            raise ValueError(
                f"a depthwise conv needs output channels ({self.features}) that "
                f"are a multiple of its input channels ({channels})"
            )
        kernel = self.param(
            "kernel", self.kernel_init, (self.kernel_size, self.kernel_size, 1, self.features)
        )
        bias = self.param("bias", self.bias_init, (self.features,))
        x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias)
        return ops.depthwise_conv(x, kernel, self.strides, self.padding) + bias


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def standardize(x: jax.Array, epsilon: float) -> jax.Array:
    """(x - mean) / sqrt(var + epsilon) over the last axis with the two-pass variance
    (PyTorch's numerics), in float32. Its backward is written out (the textbook LayerNorm
    gradient): XLA:CPU turned the autodiff of the two-pass form into one loop fusion of
    ~1,000 instructions that recomputed every later block's normalisation, the larger part
    of an XCiT step on CPU."""
    return _standardize_fwd(x, epsilon)[0]


def _standardize_fwd(x, epsilon):
    x32 = x.astype(jnp.float32)
    centered = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    inv_std = jax.lax.rsqrt(jnp.mean(jnp.square(centered), axis=-1, keepdims=True) + epsilon)
    normalized = centered * inv_std
    return normalized.astype(x.dtype), (normalized, inv_std)


def _standardize_bwd(epsilon, residuals, grad):
    normalized, inv_std = residuals
    grad32 = grad.astype(jnp.float32)
    grad_x = inv_std * (
        grad32
        - jnp.mean(grad32, axis=-1, keepdims=True)
        - normalized * jnp.mean(grad32 * normalized, axis=-1, keepdims=True)
    )
    return (grad_x.astype(grad.dtype),)


standardize.defvjp(_standardize_fwd, _standardize_bwd)


class LayerNorm(nn.Module):
    """LayerNorm over the last axis with PyTorch's two-pass variance (`standardize`), and
    flax's parameter names (scale, bias)."""

    epsilon: float = 1e-6

    @nn.compact
    def __call__(self, x):
        features = (x.shape[-1],)
        scale = self.param("scale", nn.initializers.ones, features)
        bias = self.param("bias", nn.initializers.zeros, features)
        return standardize(x, self.epsilon) * scale + bias


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
        # timm's arithmetic (x / keep * mask): one fused elementwise loop, no select.
        return x / keep * mask.astype(x.dtype)


class Mlp(nn.Module):
    hidden_dim: int
    dropout: float = 0.0
    torch_init: bool = False

    @nn.compact
    def __call__(self, x, *, train: bool):
        out_dim = x.shape[-1]
        x = dense(self.hidden_dim, **linear_init(out_dim, self.torch_init), name="fc1")(x)
        x = gelu(x)
        x = nn.Dropout(self.dropout, deterministic=not train)(x)
        x = dense(out_dim, **linear_init(self.hidden_dim, self.torch_init), name="fc2")(x)
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
    maps_unused: bool = False  # then fused attention where ops.use_fused_attention()

    @nn.compact
    def __call__(
        self, x, *, train: bool, bias: jax.Array | None = None, key_keep: jax.Array | None = None
    ):
        batch, tokens, dim = x.shape
        if dim % self.num_heads:
            raise ValueError(f"width {dim} is not divisible by num_heads {self.num_heads}")
        head_dim = dim // self.num_heads
        init = linear_init(dim, self.torch_init)
        qkv = dense(3 * dim, use_bias=self.qkv_bias, **init, name="qkv")(x)
        # Heads-major (3, B, heads, N, head_dim) in one copy, so that both attention products
        # are batched over leading axes, with no transposes around them.
        # Unstacked rather than indexed: the gradient is then one concatenation, where
        # indexing's is three zero-padded copies summed.
        qkv = qkv.reshape(batch, tokens, 3, self.num_heads, head_dim).transpose(2, 0, 3, 1, 4)
        q, k, v = jnp.unstack(qkv)
        if self._fused(train, key_keep):
            out = ops.fused_attention(
                q.transpose(0, 2, 1, 3),
                k.transpose(0, 2, 1, 3),
                v.transpose(0, 2, 1, 3),
                None if bias is None else bias.astype(q.dtype)[None, None],
                head_dim**-0.5,
            ).reshape(batch, tokens, dim)
            out = dense(dim, **init, name="proj")(out)
            return nn.Dropout(self.dropout, deterministic=not train)(out), None
        logits = ops.batched_matmul(q, jnp.swapaxes(k, -1, -2)) * head_dim**-0.5
        if self.paas:
            scale = jax.nn.sigmoid(self._att_mask(tokens)).astype(logits.dtype)
            logits = logits * ops.broadcast_over_batch(scale, batch)
        if bias is not None:
            logits = logits + bias.astype(logits.dtype)
        attn = _softmax(logits.astype(jnp.float32), key_keep).astype(x.dtype)
        attn_dropped = nn.Dropout(self.dropout, deterministic=not train)(attn)
        out = ops.batched_matmul(attn_dropped, v)
        out = out.transpose(0, 2, 1, 3).reshape(batch, tokens, dim)
        out = dense(dim, **init, name="proj")(out)
        return nn.Dropout(self.dropout, deterministic=not train)(out), attn

    def _fused(self, train: bool, key_keep: jax.Array | None) -> bool:
        """Fused attention computes no maps, has no attention dropout, no PAAS scaling of
        the logits and no key re-weighting."""
        plain = not self.paas and key_keep is None and (self.dropout == 0.0 or not train)
        return self.maps_unused and plain and ops.use_fused_attention()

    def _att_mask(self, tokens: int) -> jax.Array:
        shape = (self.num_heads, tokens, tokens)
        if self.has_variable("params", "att_mask"):
            trained = self.get_variable("params", "att_mask").shape
            if trained != shape:
                raise ValueError(
                    f"PAAS att_mask {trained} was made for {trained[-1]} tokens, the input has "
                    f"{tokens}: feed the image size it was trained at, or load the weights with "
                    f"interpolated masks (config.init_resize=True, rspc_jax.interop.state_dicts)"
                )
        return self.param("att_mask", dense_init, shape)


def _softmax(logits: jax.Array, key_keep: jax.Array | None) -> jax.Array:
    """Softmax over keys, each key's weight multiplied by key_keep (B, N) and renormalised.
    The shift is the largest kept logit and dropped logits never reach exp, so a dropped
    key however large can neither overflow nor underflow the kept ones."""
    if key_keep is None:
        return softmax(logits)
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
    maps_unused: bool = False  # nobody reads the attention map: Attention may fuse

    @nn.compact
    def __call__(self, x, train: bool, key_keep: jax.Array | None = None):
        drop_path = DropPath(self.drop_path)
        y, attn = Attention(
            self.num_heads, dropout=self.dropout, maps_unused=self.maps_unused, name="attn"
        )(
            LayerNorm(epsilon=self.layernorm_eps, name="norm1")(x),
            train=train,
            key_keep=key_keep,
        )
        x = x + drop_path(y, train=train)
        y = Mlp(self.mlp_dim, dropout=self.dropout, name="mlp")(
            LayerNorm(epsilon=self.layernorm_eps, name="norm2")(x), train=train
        )
        x = x + drop_path(y, train=train)
        return x, attn


def sow_block(module: nn.Module, x: jax.Array, attn: jax.Array | None, sow_attention: bool):
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
