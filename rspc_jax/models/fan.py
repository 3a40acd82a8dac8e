"""FAN (Zhou et al., ICML 2022), hybrid and ViT variants, as the official code builds it
(NVlabs/FAN@ee1b7df models/fan.py and models/convnext_utils.py; RSPC_FAN uses the same classes).

A two-stage ConvNeXt stem (stride 8) and HybridEmbed (conv 2/2) give 14x14 tokens for
224x224 images; a Fourier positional encoding is added once; FAN blocks pair token-mixing
self-attention with channel processing (a sigmoid channel gate over an MLP whose
depthwise convs run on the token grid, with BatchNorm); a class token then goes through
two class-attention blocks, and LayerNorm + head read it out. FAN-ViT replaces the stem
and HybridEmbed by four stride-2 conv + BatchNorm units (ConvPatchEmbed). RSPC aligns the
FAN blocks only, so only they are sown as block outputs.

Flax names mirror the PyTorch attributes with `_<i>` for list indices
(`patch_embed/backbone/stages_1/blocks_0/conv_dw`, `blocks_3/mlp/mlp_v/dwconv/bn`,
`cls_attn_blocks_0/attn/q`), so importing an official state dict is `torch_layout`'s
mechanical rename. Inits follow the official ones (timm trunc-normal(0.02) Linear layers,
N(0, sqrt(2 / fan_out)) depthwise convs, PyTorch defaults for HybridEmbed and the positional
projection, ConvNeXt layer scale 1e-6).
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from rspc_jax.models import layers, register

IMAGE_SIZE = 224
LAYERNORM_EPS = 1e-6
NORM_V_EPS = 1e-5  # ChannelProcessing.norm_v is a plain nn.LayerNorm (PyTorch default eps)
CONVNEXT_LAYER_SCALE = 1e-6
FOURIER_HIDDEN = 32
FOURIER_TEMPERATURE = 10000.0


def _layer_norm(name: str, eps: float = LAYERNORM_EPS) -> layers.LayerNorm:
    """Two-pass variance, as PyTorch computes it (flax defaults to the one-pass form)."""
    return layers.LayerNorm(epsilon=eps, name=name)


class LayerNorm2d(nn.Module):
    """ConvNeXt `LayerNorm2d` over the channels of an NHWC map.

    The official module calls F.layer_norm (biased variance) only when its input is
    contiguous NCHW; otherwise it normalises with `torch.var_mean`, whose variance is the
    unbiased one (/ (C - 1)). In the reference outputs (PyTorch CPU) the stem norm takes the
    first path and the block and downsample norms, fed by channels-last conv outputs, take
    the second; `unbiased` selects it.
    """

    unbiased: bool
    eps: float = LAYERNORM_EPS

    @nn.compact
    def __call__(self, x):
        channels = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (channels,))
        bias = self.param("bias", nn.initializers.zeros, (channels,))
        centred = x - x.mean(axis=-1, keepdims=True)
        var = jnp.sum(centred**2, axis=-1, keepdims=True) / (channels - int(self.unbiased))
        return centred * jax.lax.rsqrt(var + self.eps) * scale + bias


def _conv(
    features: int,
    kernel: int,
    name: str,
    *,
    strides: int = 1,
    padding: int = 0,
    init: dict | None = None,
) -> layers.Conv:
    """A conv with PyTorch's symmetric padding `padding` and the given initialisers."""
    return layers.Conv(features, kernel, strides, padding, **(init or {}), name=name)


def _depthwise_conv(
    features: int, kernel: int, name: str, *, padding: int, init: dict
) -> layers.DepthwiseConv:
    """PyTorch Conv2d(groups=in_channels) with the given initialisers."""
    return layers.DepthwiseConv(features, kernel, padding=padding, **init, name=name)


def _depthwise_init(kernel: int) -> dict:
    """FAN's `_init_weights` for depthwise convs: N(0, sqrt(2 / fan_out)), fan_out = k * k."""
    return {"kernel_init": nn.initializers.normal(math.sqrt(2.0 / (kernel * kernel)))}


def _torch_conv_init(in_channels: int, kernel: int) -> dict:
    return layers.linear_init(in_channels * kernel * kernel, torch_init=True)


def _dense(features: int, name: str, use_bias: bool = True) -> nn.Dense:
    return layers.dense(features, use_bias=use_bias, kernel_init=layers.dense_init, name=name)


def _to_grid(tokens: jax.Array, grid: tuple[int, int]) -> jax.Array:
    return tokens.reshape(tokens.shape[0], *grid, tokens.shape[-1])


def _to_tokens(x: jax.Array) -> jax.Array:
    """NHWC map -> (B, H*W, C), row-major like PyTorch's flatten(2).transpose(1, 2)."""
    return x.reshape(x.shape[0], -1, x.shape[-1])


class ConvMlp(nn.Module):
    """timm `ConvMlp`: 1x1 conv -> GELU -> 1x1 conv (trunc-normal(0.02) init)."""

    hidden_dim: int

    @nn.compact
    def __call__(self, x):
        init = {"kernel_init": layers.dense_init}
        y = layers.gelu(_conv(self.hidden_dim, 1, "fc1", init=init)(x))
        return _conv(x.shape[-1], 1, "fc2", init=init)(y)


class ConvNeXtBlock(nn.Module):
    """timm ConvNeXt block (conv MLP): dwconv 7/1/3 -> LN -> 1x1 -> GELU -> 1x1 -> x gamma.
    FAN builds the stem without stochastic depth."""

    @nn.compact
    def __call__(self, x):
        dim = x.shape[-1]
        y = _depthwise_conv(dim, 7, "conv_dw", padding=3, init={"kernel_init": layers.dense_init})(
            x
        )
        y = ConvMlp(4 * dim, name="mlp")(LayerNorm2d(unbiased=True, name="norm")(y))
        gamma = self.param("gamma", nn.initializers.constant(CONVNEXT_LAYER_SCALE), (dim,))
        return x + y * gamma


class ConvNeXtStage(nn.Module):
    """A stage; every stage but the first starts with LayerNorm2d + conv 2/2 (`downsample`)."""

    dim: int
    depth: int
    downsample: bool

    @nn.compact
    def __call__(self, x):
        if self.downsample:
            x = LayerNorm2d(unbiased=True, name="downsample_0")(x)
            x = _conv(
                self.dim, 2, "downsample_1", strides=2, init={"kernel_init": layers.dense_init}
            )(x)
        for i in range(self.depth):
            x = ConvNeXtBlock(name=f"blocks_{i}")(x)
        return x


class ConvNeXtStem(nn.Module):
    """FAN's `_create_hybrid_backbone`: stem conv 4/4 + LayerNorm2d, then one stage per depth."""

    depths: tuple[int, ...]
    dims: tuple[int, ...]

    @nn.compact
    def __call__(self, images):
        x = _conv(self.dims[0], 4, "stem_0", strides=4, init={"kernel_init": layers.dense_init})(
            images
        )
        x = LayerNorm2d(unbiased=False, name="stem_1")(x)
        for i, (depth, dim) in enumerate(zip(self.depths, self.dims)):
            x = ConvNeXtStage(dim, depth, downsample=i > 0, name=f"stages_{i}")(x)
        return x


class HybridEmbed(nn.Module):
    """ConvNeXt stem, then conv patch/patch (`proj`, PyTorch init) to the embedding width."""

    embed_dim: int
    patch: int
    stem_depths: tuple[int, ...]
    stem_dims: tuple[int, ...]

    @nn.compact
    def __call__(self, images):
        x = ConvNeXtStem(self.stem_depths, self.stem_dims, name="backbone")(images)
        return _conv(
            self.embed_dim,
            self.patch,
            "proj",
            strides=self.patch,
            init=_torch_conv_init(x.shape[-1], self.patch),
        )(x)


class ConvBN(nn.Module):
    """FAN/XCiT `conv3x3` unit: conv 3/stride/1 without bias (PyTorch init) + BatchNorm; the
    PyTorch Sequential indices 0 and 1 are the flax names."""

    features: int
    strides: int = 2
    bn_axis_name: str | None = None

    @nn.compact
    def __call__(self, x, *, train: bool):
        x = layers.Conv(
            self.features,
            3,
            self.strides,
            padding=1,
            use_bias=False,
            **_torch_conv_init(x.shape[-1], 3),
            name="0",
        )(x)
        return layers.batch_norm(train, self.bn_axis_name, "1")(x)


# patch size -> (width divisor, stride) of each ConvBN unit. 16 and 8 are the official
# (timm XCiT / FAN-ViT) stems; 4 is the patch-16 stem with its first two strides set to 1,
# the thesis's adaptation for 32x32 CIFAR images (002, "Adapting to small resolution
# images"), which keeps the patch-16 weights loadable.
CONV_PATCH_EMBED_UNITS = {
    16: ((8, 2), (4, 2), (2, 2), (1, 2)),
    8: ((4, 2), (2, 2), (1, 2)),
    4: ((8, 1), (4, 1), (2, 2), (1, 2)),
}


class ConvPatchEmbed(nn.Module):
    """XCiT / FAN-ViT stem: ConvBN units with GELU between them, at PyTorch Sequential
    indices 0, 2, 4, ... (`proj_0`, `proj_2`, ...)."""

    embed_dim: int
    patch_size: int = 16
    bn_axis_name: str | None = None

    @nn.compact
    def __call__(self, images, *, train: bool):
        if self.patch_size not in CONV_PATCH_EMBED_UNITS:
            raise ValueError(
                f"conv patch embedding supports patch sizes "
                f"{sorted(CONV_PATCH_EMBED_UNITS)}, got {self.patch_size}"
            )
        x = images
        for i, (divisor, stride) in enumerate(CONV_PATCH_EMBED_UNITS[self.patch_size]):
            if i:
                x = layers.gelu(x)
            x = ConvBN(self.embed_dim // divisor, stride, self.bn_axis_name, name=f"proj_{2 * i}")(
                x, train=train
            )
        return x


def fourier_features(grid: tuple[int, int]) -> np.ndarray:
    """The (H, W, 64) sin/cos features of `PositionalEncodingFourier`, in float32 as PyTorch
    computes them: (y-features, x-features), each sin/cos interleaved."""
    height, width = grid
    scale = np.float32(2 * math.pi)
    eps = np.float32(1e-6)
    y = np.arange(1, height + 1, dtype=np.float32)
    x = np.arange(1, width + 1, dtype=np.float32)
    y = y / (y[-1] + eps) * scale
    x = x / (x[-1] + eps) * scale
    k = np.arange(FOURIER_HIDDEN, dtype=np.float32)
    dim_t = np.float32(FOURIER_TEMPERATURE) ** (2 * np.floor(k / 2) / FOURIER_HIDDEN)

    def encode(values):
        pos = values[:, None] / dim_t
        return np.stack([np.sin(pos[:, 0::2]), np.cos(pos[:, 1::2])], axis=-1).reshape(
            len(values), FOURIER_HIDDEN
        )

    pos_y = np.broadcast_to(encode(y)[:, None], (height, width, FOURIER_HIDDEN))
    pos_x = np.broadcast_to(encode(x)[None, :], (height, width, FOURIER_HIDDEN))
    return np.concatenate([pos_y, pos_x], axis=-1).astype(np.float32)


class PositionalEncodingFourier(nn.Module):
    """Fixed Fourier features projected by a 1x1 conv (`token_projection`); (H*W, D)."""

    dim: int

    @nn.compact
    def __call__(self, grid: tuple[int, int]):
        features = jnp.asarray(fourier_features(grid))[None]
        pos = _conv(self.dim, 1, "token_projection", init=_torch_conv_init(2 * FOURIER_HIDDEN, 1))(
            features
        )
        return pos.reshape(-1, self.dim)


class TokenMixing(nn.Module):
    """Self-attention with split q / kv ([k; v], head-major) projections; q is scaled first.
    `bias` (N, N) is added to the logits before the softmax (`interventions`)."""

    num_heads: int
    qkv_bias: bool = True

    @nn.compact
    def __call__(self, x, bias: jax.Array | None = None):
        batch, tokens, dim = x.shape
        head_dim = dim // self.num_heads
        q = _dense(dim, "q", self.qkv_bias)(x).reshape(batch, tokens, self.num_heads, head_dim)
        kv = _dense(2 * dim, "kv", self.qkv_bias)(x).reshape(
            batch, tokens, 2, self.num_heads, head_dim
        )
        k, v = jnp.unstack(kv, axis=2)  # see layers.Attention
        logits = jnp.einsum("bqhd,bkhd->bhqk", q * head_dim**-0.5, k)
        if bias is not None:
            logits = logits + bias.astype(logits.dtype)
        attn = layers.softmax(logits, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(batch, tokens, dim)
        return _dense(dim, "proj")(out), attn


class DWConv(nn.Module):
    """Depthwise conv 3/1/1 -> GELU -> BatchNorm -> depthwise conv 3/1/1 on the token grid
    (FAN's `DWConv`; XCiT's `LPI` is the same module with PyTorch's default conv init)."""

    bn_axis_name: str | None = None
    torch_init: bool = False

    @nn.compact
    def __call__(self, x, grid: tuple[int, int], *, train: bool):
        dim = x.shape[-1]
        init = _torch_conv_init(1, 3) if self.torch_init else _depthwise_init(3)
        y = _depthwise_conv(dim, 3, "conv1", padding=1, init=init)(_to_grid(x, grid))
        y = layers.batch_norm(train, self.bn_axis_name, "bn")(layers.gelu(y))
        y = _depthwise_conv(dim, 3, "conv2", padding=1, init=init)(y)
        return _to_tokens(y)


class ChannelMlp(nn.Module):
    """FAN's `Mlp` (ChannelProcessing.mlp_v): fc1 -> x + gamma * DWConv(x) -> fc2.

    There is no activation after fc1: the official `act` attribute is never called.
    """

    hidden_dim: int
    bn_axis_name: str | None = None

    @nn.compact
    def __call__(self, x, grid: tuple[int, int], *, train: bool):
        dim = x.shape[-1]
        x = _dense(self.hidden_dim, "fc1")(x)
        gamma = self.param("gamma", nn.initializers.ones, (self.hidden_dim,))
        x = gamma * DWConv(self.bn_axis_name, name="dwconv")(x, grid, train=train) + x
        return _dense(dim, "fc2")(x)


class ChannelProcessing(nn.Module):
    """Channel attention (paper Eq. 7): a per-channel sigmoid gate from token-softmaxed q and
    channel-averaged, token-softmaxed k = x, times `temperature`, applied to norm_v(mlp_v(x))."""

    num_heads: int
    hidden_dim: int
    qkv_bias: bool = True
    bn_axis_name: str | None = None

    @nn.compact
    def __call__(self, x, grid: tuple[int, int], *, train: bool):
        batch, tokens, dim = x.shape
        heads, head_dim = self.num_heads, dim // self.num_heads
        temperature = self.param("temperature", nn.initializers.ones, (heads, 1, 1))
        q = _dense(dim, "q", self.qkv_bias)(x).reshape(batch, tokens, heads, head_dim)
        k = x.reshape(batch, tokens, heads, head_dim)
        q = layers.softmax(q, axis=1)
        k = layers.softmax(k, axis=1).mean(axis=-1)
        gate = jax.nn.sigmoid(jnp.einsum("bnhd,bnh->bhd", q, k)) * temperature[:, :, 0]
        v = ChannelMlp(self.hidden_dim, self.bn_axis_name, name="mlp_v")(x, grid, train=train)
        v = _layer_norm("norm_v", NORM_V_EPS)(v).reshape(batch, tokens, heads, head_dim)
        return (gate[:, None] * v).reshape(batch, tokens, dim)


class FANBlock(nn.Module):
    """x += gamma1 * TokenMixing(norm1(x)); x += gamma2 * ChannelProcessing(norm2(x))."""

    num_heads: int
    mlp_ratio: float
    qkv_bias: bool = True
    eta: float = 1.0
    drop_path: float = 0.0
    bn_axis_name: str | None = None

    @nn.compact
    def __call__(self, x, grid: tuple[int, int], train: bool):
        dim = x.shape[-1]
        if dim % self.num_heads:
            raise ValueError(f"width {dim} is not divisible by num_heads {self.num_heads}")
        drop_path = layers.DropPath(self.drop_path)
        scale_init = nn.initializers.constant(self.eta)
        gamma1 = self.param("gamma1", scale_init, (dim,))
        gamma2 = self.param("gamma2", scale_init, (dim,))
        y, attn = TokenMixing(self.num_heads, self.qkv_bias, name="attn")(_layer_norm("norm1")(x))
        x = x + drop_path(gamma1 * y, train=train)
        y = ChannelProcessing(
            self.num_heads, int(dim * self.mlp_ratio), self.qkv_bias, self.bn_axis_name, name="mlp"
        )(_layer_norm("norm2")(x), grid, train=train)
        return x + drop_path(gamma2 * y, train=train), attn


class ClassAttn(nn.Module):
    """timm CaiT `ClassAttn`: the class token (token 0) attends to all tokens; returns the
    output (B, 1, D) and the class token's attention row (B, heads, 1, N + 1)."""

    num_heads: int
    qkv_bias: bool = True

    @nn.compact
    def __call__(self, x):
        batch, tokens, dim = x.shape
        head_dim = dim // self.num_heads
        q = _dense(dim, "q", self.qkv_bias)(x[:, 0]).reshape(batch, self.num_heads, head_dim)
        k = _dense(dim, "k", self.qkv_bias)(x).reshape(batch, tokens, self.num_heads, head_dim)
        v = _dense(dim, "v", self.qkv_bias)(x).reshape(batch, tokens, self.num_heads, head_dim)
        attn = layers.softmax(jnp.einsum("bhd,bkhd->bhk", q * head_dim**-0.5, k), axis=-1)
        out = jnp.einsum("bhk,bkhd->bhd", attn, v).reshape(batch, 1, dim)
        return _dense(dim, "proj")(out), attn[:, :, None]


class ClassAttentionBlock(nn.Module):
    """FAN's class-attention block. Patch tokens receive their norm1 values in the attention
    residual; with tokens_norm the official MLP residual (x_res + [mlp(cls); x[:, 1:]]) adds
    the norm2 patch tokens to themselves, so they leave as 2 * norm2(x)[:, 1:]."""

    num_heads: int
    mlp_ratio: float
    qkv_bias: bool = True
    eta: float = 1.0
    tokens_norm: bool = True

    @nn.compact
    def __call__(self, x, *, train: bool):
        dim = x.shape[-1]
        scale_init = nn.initializers.constant(self.eta)
        gamma1 = self.param("gamma1", scale_init, (dim,))
        gamma2 = self.param("gamma2", scale_init, (dim,))
        x_norm = _layer_norm("norm1")(x)
        cls, attn = ClassAttn(self.num_heads, self.qkv_bias, name="attn")(x_norm)
        x = x + gamma1 * jnp.concatenate([cls, x_norm[:, 1:]], axis=1)
        norm2 = _layer_norm("norm2")
        x = norm2(x) if self.tokens_norm else jnp.concatenate([norm2(x[:, :1]), x[:, 1:]], 1)
        cls = gamma2 * layers.Mlp(int(dim * self.mlp_ratio), name="mlp")(x[:, :1], train=train)
        return x + jnp.concatenate([cls, x[:, 1:]], axis=1), attn


class FAN(nn.Module):
    """Official `FAN`: FAN-Hybrid (ConvNeXt stem + HybridEmbed) or FAN-ViT (ConvPatchEmbed).

    Attributes:
      hybrid: the ConvNeXt + HybridEmbed stem (official `backbone=...`); False gives the
        patch-16 ConvPatchEmbed of the FAN-ViT models.
      stem_depths, stem_dims: ConvNeXt blocks and width per stem stage (official
        `_create_hybrid_backbone(depths, dims)`; only len(depths) entries of dims are used).
      hybrid_patch_size: HybridEmbed conv kernel = stride.
      drop_path_rate: the same stochastic-depth rate in every FAN block (official).
      head_init_scale: multiplies the head's init (0.001 for FAN-L-Hybrid).
      remat: recompute each FAN block's activations in the backward pass.
      bn_axis_name: mesh axis over which BatchNorm batch statistics are averaged.
    """

    num_classes: int
    embed_dim: int = 192
    depth: int = 8
    num_heads: int = 8
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    hybrid: bool = True
    stem_depths: tuple[int, ...] = (3, 3)
    stem_dims: tuple[int, ...] = (128, 256)
    hybrid_patch_size: int = 2
    cls_attn_layers: int = 2
    tokens_norm: bool = True
    eta: float = 1.0
    head_init_scale: float = 1.0
    drop_path_rate: float = 0.0
    remat: bool = False
    bn_axis_name: str | None = None

    patch_size = 16  # hybrid: stem stride 4 * 2, HybridEmbed stride 2; ViT: four stride-2 convs
    no_weight_decay_names = ("cls_token",)  # official no_weight_decay(); `pos_embed` is a module

    @nn.compact
    def __call__(self, images, *, train: bool, sow_attention: bool = False):
        x = self._patch_embed(images, train)
        grid = x.shape[1:3]
        x = _to_tokens(x) + PositionalEncodingFourier(self.embed_dim, name="pos_embed")(grid)
        block = layers.maybe_remat(FANBlock, self.remat, static_argnums=(2, 3))
        for i in range(self.depth):
            x, attn = block(
                self.num_heads,
                self.mlp_ratio,
                self.qkv_bias,
                self.eta,
                self.drop_path_rate,
                self.bn_axis_name,
                name=f"blocks_{i}",
            )(x, grid, train)
            layers.sow_block(self, x, attn, sow_attention)
        cls_token = self.param("cls_token", layers.dense_init, (1, 1, self.embed_dim))
        x = jnp.concatenate([jnp.broadcast_to(cls_token, (x.shape[0], 1, self.embed_dim)), x], 1)
        for i in range(self.cls_attn_layers):
            x, attn = ClassAttentionBlock(
                self.num_heads,
                self.mlp_ratio,
                self.qkv_bias,
                self.eta,
                self.tokens_norm,
                name=f"cls_attn_blocks_{i}",
            )(x, train=train)
            layers.sow_class_attention(self, attn, sow_attention)
        x = _layer_norm("norm")(x)[:, 0]
        head_init = nn.initializers.truncated_normal(0.02 * self.head_init_scale)
        return layers.dense(self.num_classes, kernel_init=head_init, name="head")(x)

    def _patch_embed(self, images, train: bool) -> jax.Array:
        if self.hybrid:
            return HybridEmbed(
                self.embed_dim,
                self.hybrid_patch_size,
                tuple(self.stem_depths),
                tuple(self.stem_dims),
                name="patch_embed",
            )(images)
        return ConvPatchEmbed(self.embed_dim, 16, self.bn_axis_name, name="patch_embed")(
            images, train=train
        )


def _variant(
    embed_dim: int,
    depth: int,
    num_heads: int,
    stem_depths: tuple[int, ...] = (),
    head_init_scale: float = 1.0,
):
    """A factory; no stem depths means the FAN-ViT ConvPatchEmbed stem."""

    def factory(num_classes: int, **overrides) -> FAN:
        kwargs = dict(
            embed_dim=embed_dim,
            depth=depth,
            num_heads=num_heads,
            hybrid=bool(stem_depths),
            stem_depths=stem_depths or (3, 3),
            head_init_scale=head_init_scale,
        )
        kwargs.update(overrides)
        return FAN(num_classes=num_classes, **kwargs)

    return factory


# The official hybrid factories (models/fan.py fan_*_p4_hybrid); FAN-S-Hybrid has 10 blocks.
register("fan_tiny_8_p4_hybrid")(_variant(192, 8, 8, (3, 3)))
register("fan_small_12_p4_hybrid")(_variant(384, 10, 8, (3, 3)))
register("fan_base_16_p4_hybrid")(_variant(448, 16, 8, (3, 3)))
register("fan_large_16_p4_hybrid")(_variant(480, 22, 10, (3, 5), head_init_scale=0.001))

# The official FAN-ViT factories (models/fan.py fan_*_12_p16_224).
register("fan_tiny_12_p16_224")(_variant(192, 12, 4))
register("fan_small_12_p16_224")(_variant(384, 12, 8))
