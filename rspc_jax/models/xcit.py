"""XCiT (El-Nouby et al. 2021) as timm builds it (timm/models/xcit.py), the model of the
adversarial-robustness thesis (Debenedetti, EPFL 2022) that RSPC users compare against.

Cross-covariance attention (XCA) attends over channels: per head, q and k are L2-normalised
along the tokens and the d x d matrix softmax(q k^T * temperature) mixes the channels of v.
Each XCA block adds local patch interaction (LPI: depthwise convs with BatchNorm on the token
grid) between attention and MLP, all three branches with layer scale. The conv patch
embedding, Fourier positional encoding and class-attention blocks are the modules FAN
copied from XCiT, so they are shared with `fan.py`. RSPC aligns the XCA blocks; the attention
maps sown on request are the d x d channel maps (B, heads, d, d).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from rspc_jax.models import fan, layers, register

L2_NORMALIZE_EPS = 1e-12  # F.normalize default


def _l2_normalize(x: jax.Array, axis: int) -> jax.Array:
    norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=axis, keepdims=True))
    return x / jnp.maximum(norm, L2_NORMALIZE_EPS)


class XCA(nn.Module):
    """Cross-covariance attention; qkv rows are [q; k; v], head-major, as in timm."""

    num_heads: int
    qkv_bias: bool = True

    @nn.compact
    def __call__(self, x):
        batch, tokens, dim = x.shape
        heads, head_dim = self.num_heads, dim // self.num_heads
        temperature = self.param("temperature", nn.initializers.ones, (heads, 1, 1))
        qkv = fan._dense(3 * dim, "qkv", self.qkv_bias)(x).reshape(
            batch, tokens, 3, heads, head_dim
        )
        q, k, v = jnp.unstack(qkv, axis=2)  # see layers.Attention
        q, k = _l2_normalize(q, axis=1), _l2_normalize(k, axis=1)
        logits = jnp.einsum("bnhc,bnhd->bhcd", q, k) * temperature
        attn = layers.softmax(logits.astype(jnp.float32), axis=-1).astype(x.dtype)
        out = jnp.einsum("bhcd,bnhd->bnhc", attn, v).reshape(batch, tokens, dim)
        return fan._dense(dim, "proj")(out), attn


class XCABlock(nn.Module):
    """x += g1 * XCA(norm1(x)); x += g3 * LPI(norm3(x)); x += g2 * MLP(norm2(x))."""

    num_heads: int
    mlp_ratio: float = 4.0
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
        gamma3 = self.param("gamma3", scale_init, (dim,))
        gamma2 = self.param("gamma2", scale_init, (dim,))
        y, attn = XCA(self.num_heads, self.qkv_bias, name="attn")(fan._layer_norm("norm1")(x))
        x = x + drop_path(gamma1 * y, train=train)
        y = fan.DWConv(self.bn_axis_name, torch_init=True, name="local_mp")(
            fan._layer_norm("norm3")(x), grid, train=train
        )
        x = x + drop_path(gamma3 * y, train=train)
        y = layers.Mlp(int(dim * self.mlp_ratio), name="mlp")(
            fan._layer_norm("norm2")(x), train=train
        )
        return x + drop_path(gamma2 * y, train=train), attn


class XCiT(nn.Module):
    """timm `Xcit` with the default `global_pool='token'`.

    Attributes:
      patch_size: 16 or 8 (timm), or 4: the patch-16 stem with stride 1 in its first two
        convs (the thesis's CIFAR fine-tuning at 32x32; patch-16 weights load unchanged).
      eta: layer-scale init (1.0 for depth 12, 1e-5 for depth 24 in timm).
      tokens_norm: class-attention norm2 on all tokens (False only for nano).
      drop_path_rate: the same rate in every XCA block (timm), none in class attention.
      remat: recompute each XCA block's activations in the backward pass.
      bn_axis_name: mesh axis over which BatchNorm batch statistics are averaged.
    """

    num_classes: int
    patch_size: int = 16
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    cls_attn_layers: int = 2
    eta: float = 1.0
    tokens_norm: bool = True
    drop_path_rate: float = 0.0
    remat: bool = False
    bn_axis_name: str | None = None

    no_weight_decay_names = ("cls_token",)  # timm no_weight_decay(); `pos_embed` is a module

    @nn.compact
    def __call__(self, images, *, train: bool, sow_attention: bool = False):
        height, width = images.shape[1:3]
        if height % self.patch_size or width % self.patch_size:
            raise ValueError(
                f"image size {height}x{width} is not divisible by patch_size {self.patch_size}"
            )
        x = fan.ConvPatchEmbed(
            self.embed_dim, self.patch_size, self.bn_axis_name, name="patch_embed"
        )(images, train=train)
        grid = x.shape[1:3]
        x = fan._to_tokens(x) + fan.PositionalEncodingFourier(self.embed_dim, name="pos_embed")(
            grid
        )
        block = layers.maybe_remat(XCABlock, self.remat, static_argnums=(2, 3))
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
            x, attn = fan.ClassAttentionBlock(
                self.num_heads,
                self.mlp_ratio,
                self.qkv_bias,
                self.eta,
                self.tokens_norm,
                name=f"cls_attn_blocks_{i}",
            )(x, train=train)
            layers.sow_class_attention(self, attn, sow_attention)
        x = fan._layer_norm("norm")(x)[:, 0]
        return layers.dense(self.num_classes, kernel_init=layers.dense_init, name="head")(x)


def _variant(
    embed_dim: int,
    depth: int,
    num_heads: int,
    patch_size: int,
    eta: float,
    tokens_norm: bool = True,
):
    def factory(num_classes: int, **overrides) -> XCiT:
        kwargs = dict(
            embed_dim=embed_dim,
            depth=depth,
            num_heads=num_heads,
            patch_size=patch_size,
            eta=eta,
            tokens_norm=tokens_norm,
        )
        kwargs.update(overrides)
        return XCiT(num_classes=num_classes, **kwargs)

    return factory


# timm's factories (xcit.py), patch 16 and 8.
for _patch in (16, 8):
    register(f"xcit_nano_12_p{_patch}_224")(_variant(128, 12, 4, _patch, 1.0, tokens_norm=False))
    register(f"xcit_tiny_12_p{_patch}_224")(_variant(192, 12, 4, _patch, 1.0))
    register(f"xcit_small_12_p{_patch}_224")(_variant(384, 12, 8, _patch, 1.0))
    register(f"xcit_tiny_24_p{_patch}_224")(_variant(192, 24, 4, _patch, 1e-5))
    register(f"xcit_small_24_p{_patch}_224")(_variant(384, 24, 8, _patch, 1e-5))
    register(f"xcit_medium_24_p{_patch}_224")(_variant(512, 24, 8, _patch, 1e-5))
    register(f"xcit_large_24_p{_patch}_224")(_variant(768, 24, 16, _patch, 1e-5))
# The thesis's 12-layer M12 and L12 (002: depth-12 models initialise layer scale to 1).
register("xcit_medium_12_p16_224")(_variant(512, 12, 8, 16, 1.0))
register("xcit_large_12_p16_224")(_variant(768, 12, 16, 16, 1.0))
