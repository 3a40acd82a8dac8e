"""RVT / RVT* (Mao et al., CVPR 2022), as the official code builds it
(guoyongcs/RSPC RSPC_RVT/robust_models.py, same model code as vtddggg/Robust-Vision-Transformer).

Conv stem without activations (conv 7/2 -> BN -> max-pool 3/2 -> conv 4/4: 224 -> 14x14
tokens), no positional embedding, pre-norm blocks whose MLP is a conv MLP with BatchNorm on
the token grid (a plain Linear MLP at width 768, as in the official code), a grouped stride-2
conv between stages (RVT-Ti), then GAP, LayerNorm and head. RVT* adds PAAS (`att_mask`) to
the leading `masked_block` blocks of stage 0. The official mask is fixed to 14x14 tokens
(224x224 inputs); here it takes the token count of the input the model is initialised
with (196 at 224 px, as official), and `interop` interpolates trained masks to other sizes.

Flax names mirror the PyTorch attributes with `_<i>` for list indices (`patch_embed/proj_0`,
`transformers_0/blocks_0/attn/qkv`, `pools_0/conv`, `norm`, `head`), so importing an
official state dict is a mechanical rename (`torch_layout`, `interop`). Linear and conv layers keep
PyTorch's default init, as the official model does (it only re-initialises LayerNorm).
"""

import flax.linen as nn

from rspc_jax.models import layers, ops, register

STEM_CHANNELS = 32
LINEAR_MLP_WIDTH = 768  # the official Mlp switches to Linear layers at exactly this width
LAYERNORM_EPS = 1e-6


def _conv(
    features: int, kernel: int, in_channels: int, name: str, strides: int = 1, padding: int = 0
) -> layers.Conv:
    """A conv with PyTorch's default init and symmetric padding."""
    init = layers.linear_init(in_channels * kernel * kernel, torch_init=True)
    return layers.Conv(features, kernel, strides, padding, **init, name=name)


def _depthwise_conv(
    features: int, kernel: int, name: str, strides: int = 1, padding: int = 0
) -> layers.DepthwiseConv:
    """PyTorch Conv2d(groups=in_channels) with its default init (fan_in = k * k)."""
    init = layers.linear_init(kernel * kernel, torch_init=True)
    return layers.DepthwiseConv(features, kernel, strides, padding, **init, name=name)


class ConvEmbedding(nn.Module):
    """Official `conv_embedding`: conv 7/2/2 -> BN -> max-pool 3/2/1 -> conv 4/4, no activation."""

    out_channels: int
    bn_axis_name: str | None = None

    @nn.compact
    def __call__(self, images, *, train: bool):
        x = _conv(STEM_CHANNELS, 7, images.shape[-1], strides=2, padding=2, name="proj_0")(images)
        x = layers.batch_norm(train, self.bn_axis_name, "proj_1")(x)
        x = ops.max_pool(x, 3, strides=2, padding=1)
        return _conv(self.out_channels, 4, STEM_CHANNELS, strides=4, name="proj_3")(x)


class ConvMlp(nn.Module):
    """Official conv MLP on the token grid: 1x1 conv -> BN -> GELU -> depthwise 3x3 -> BN ->
    GELU -> 1x1 conv -> BN (dropout after the first GELU and at the end)."""

    hidden_dim: int
    dropout: float = 0.0
    bn_axis_name: str | None = None

    @nn.compact
    def __call__(self, x, grid: tuple[int, int], *, train: bool):
        batch, tokens, dim = x.shape
        hidden = self.hidden_dim
        x = x.reshape(batch, *grid, dim)  # row-major tokens -> NHWC
        x = layers.batch_norm(train, self.bn_axis_name, "bn1")(_conv(hidden, 1, dim, name="fc1")(x))
        x = nn.Dropout(self.dropout, deterministic=not train)(layers.gelu(x))
        x = _depthwise_conv(hidden, 3, padding=1, name="dwconv")(x)
        x = layers.gelu(layers.batch_norm(train, self.bn_axis_name, "bn2")(x))
        x = layers.batch_norm(train, self.bn_axis_name, "bn3")(_conv(dim, 1, hidden, name="fc2")(x))
        x = nn.Dropout(self.dropout, deterministic=not train)(x)
        return x.reshape(batch, tokens, dim)


class Block(nn.Module):
    """Pre-norm block: x += attn(norm1(x)) (with PAAS if `paas`); x += mlp(norm2(x))."""

    num_heads: int
    mlp_ratio: float
    paas: bool = False
    drop_path: float = 0.0
    dropout: float = 0.0
    bn_axis_name: str | None = None
    maps_unused: bool = False  # nobody reads the attention map: Attention may fuse

    @nn.compact
    def __call__(self, x, grid: tuple[int, int], train: bool):
        dim = x.shape[-1]
        drop_path = layers.DropPath(self.drop_path)
        y, attn = layers.Attention(
            self.num_heads,
            dropout=self.dropout,
            torch_init=True,
            paas=self.paas,
            maps_unused=self.maps_unused,
            name="attn",
        )(layers.LayerNorm(epsilon=LAYERNORM_EPS, name="norm1")(x), train=train)
        x = x + drop_path(y, train=train)
        y = layers.LayerNorm(epsilon=LAYERNORM_EPS, name="norm2")(x)
        hidden = int(dim * self.mlp_ratio)
        if dim == LINEAR_MLP_WIDTH:
            y = layers.Mlp(hidden, dropout=self.dropout, torch_init=True, name="mlp")(
                y, train=train
            )
        else:
            y = ConvMlp(hidden, self.dropout, self.bn_axis_name, name="mlp")(y, grid, train=train)
        return x + drop_path(y, train=train), attn


class Transformer(nn.Module):
    """One stage on an NHWC map; returns the map and every block's (tokens, attention)."""

    num_heads: int
    mlp_ratio: float
    drop_path_rates: tuple[float, ...]
    masked_block: int = 0
    dropout: float = 0.0
    remat: bool = False
    bn_axis_name: str | None = None
    maps_unused: bool = False

    @nn.compact
    def __call__(self, x, *, train: bool):
        batch, height, width, channels = x.shape
        x = x.reshape(batch, height * width, channels)  # row-major token order
        outputs = []
        block = layers.maybe_remat(Block, self.remat, static_argnums=(2, 3))
        for i, rate in enumerate(self.drop_path_rates):
            x, attn = block(
                self.num_heads,
                self.mlp_ratio,
                paas=i < self.masked_block,
                drop_path=rate,
                dropout=self.dropout,
                bn_axis_name=self.bn_axis_name,
                maps_unused=self.maps_unused,
                name=f"blocks_{i}",
            )(x, (height, width), train)
            outputs.append((x, attn))
        return x.reshape(batch, height, width, channels), outputs


class ConvHeadPooling(nn.Module):
    """Official `conv_head_pooling`: conv 3/2/1 grouped by input channel (out = k * in)."""

    out_channels: int

    @nn.compact
    def __call__(self, x):
        return _depthwise_conv(self.out_channels, 3, strides=2, padding=1, name="conv")(x)


class RVT(nn.Module):
    """Official `PoolingTransformer`: stage s has width base_dims[s] * heads[s].

    Attributes:
      masked_block: PAAS in the first `masked_block` blocks of stage 0 (0 = plain RVT).
      dropout: the official drop_rate (after the stem, in attention projection and MLP),
        also used as the attention-map dropout (official attn_drop_rate, 0 in all recipes).
      remat: recompute each block's activations in the backward pass.
      bn_axis_name: mesh axis over which BatchNorm batch statistics are averaged.
    """

    num_classes: int
    base_dims: tuple[int, ...] = (64,)
    depth: tuple[int, ...] = (12,)
    heads: tuple[int, ...] = (6,)
    mlp_ratio: float = 4.0
    masked_block: int = 0
    drop_path_rate: float = 0.0
    dropout: float = 0.0
    remat: bool = False
    bn_axis_name: str | None = None

    patch_size = 16  # stem stride 2 * 2 * 4
    no_weight_decay_names = ()  # the official no_weight_decay() names no RVT parameter

    @nn.compact
    def __call__(self, images, *, train: bool, sow_attention: bool = False):
        widths = self._widths()
        x = ConvEmbedding(widths[0], self.bn_axis_name, name="patch_embed")(images, train=train)
        x = nn.Dropout(self.dropout, deterministic=not train)(x)
        rates = layers.drop_path_rates(self.drop_path_rate, sum(self.depth), endpoint=False)
        for stage, depth in enumerate(self.depth):
            if stage:
                x = ConvHeadPooling(widths[stage], name=f"pools_{stage - 1}")(x)
            start = sum(self.depth[:stage])
            x, outputs = Transformer(
                self.heads[stage],
                self.mlp_ratio,
                tuple(rates[start : start + depth]),
                masked_block=self.masked_block if stage == 0 else 0,
                dropout=self.dropout,
                remat=self.remat,
                bn_axis_name=self.bn_axis_name,
                maps_unused=not sow_attention,
                name=f"transformers_{stage}",
            )(x, train=train)
            for tokens, attn in outputs:
                layers.sow_block(self, tokens, attn, sow_attention)
        x = layers.LayerNorm(epsilon=LAYERNORM_EPS, name="norm")(x.mean(axis=(1, 2)))
        return layers.dense(
            self.num_classes, **layers.linear_init(widths[-1], torch_init=True), name="head"
        )(x)

    def _widths(self) -> list[int]:
        if not len(self.base_dims) == len(self.depth) == len(self.heads):
            raise ValueError(
                f"base_dims {self.base_dims}, depth {self.depth} and heads "
                f"{self.heads} need one entry per stage"
            )
        return [dim * heads for dim, heads in zip(self.base_dims, self.heads)]


def _variant(
    base_dims: tuple[int, ...],
    depth: tuple[int, ...],
    heads: tuple[int, ...],
    masked_block: int = 0,
):
    def factory(num_classes: int, **overrides) -> RVT:
        kwargs = dict(base_dims=base_dims, depth=depth, heads=heads, masked_block=masked_block)
        kwargs.update(overrides)
        return RVT(num_classes=num_classes, **kwargs)

    return factory


# The official factories (RSPC_RVT/robust_models.py rvt_tiny ... rvt_base_plus).
register("rvt_tiny")(_variant((32, 32), (10, 2), (6, 12)))
register("rvt_tiny_plus")(_variant((32, 32), (10, 2), (6, 12), masked_block=10))
register("rvt_small")(_variant((64,), (12,), (6,)))
register("rvt_small_plus")(_variant((64,), (12,), (6,), masked_block=5))
register("rvt_base")(_variant((64,), (12,), (12,)))
register("rvt_base_plus")(_variant((64,), (12,), (12,), masked_block=5))
