"""CaiT (Touvron et al., "Going deeper with Image Transformers", ICCV 2021) as timm builds it
(timm `Cait`), one of the three architectures Debenedetti's thesis compares under
adversarial training (4.1.4: DeiT-S, XCiT-S12 and CaiT-S12).

A ViT without a class token in its self-attention stage: patch tokens plus a learned
position embedding go through LayerScale blocks (each residual branch multiplied by a
learned per-channel gamma) whose attention is talking-heads attention (the logits and the
softmax weights are each mixed across heads by a learned heads x heads linear map). Then a
class token is refined by class-attention blocks (only the class token queries; keys and
values are the class token and the frozen patch tokens), normalised and classified.

RSPC aligns the self-attention blocks (the class-attention blocks leave the patch tokens
unchanged). The attention maps sown on request are the softmax outputs of the
self-attention blocks (B, heads, N, N), before `proj_w` mixes them across heads (the last
point where each row is a distribution over keys); class-attention rows go to
`class_attention_maps`.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from rspc_jax.models import fan, layers, register, vit

# Layers as FAN and XCiT build them (LayerNorm eps 1e-6, timm's Linear init); CaiT's class
# attention is the same timm `ClassAttn` (fan.ClassAttn).
_layer_norm = fan._layer_norm
_dense = fan._dense


def _mix_heads(attention: jax.Array, name: str) -> jax.Array:
    """A Linear(heads, heads) over the head axis of (B, heads, N, M) maps (talking heads)."""
    heads = attention.shape[1]
    return _dense(heads, name)(attention.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)


class TalkingHeadAttn(nn.Module):
    """timm `TalkingHeadAttn`: fused `qkv` [q; k; v], logits mixed across heads by `proj_l`
    before the softmax and the weights by `proj_w` after it. Returns the output and the
    softmax map."""

    num_heads: int
    qkv_bias: bool = True
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, *, train: bool):
        batch, tokens, dim = x.shape
        if dim % self.num_heads:
            raise ValueError(f"width {dim} is not divisible by num_heads {self.num_heads}")
        head_dim = dim // self.num_heads
        qkv = _dense(3 * dim, "qkv", self.qkv_bias)(x)
        qkv = qkv.reshape(batch, tokens, 3, self.num_heads, head_dim).transpose(2, 0, 3, 1, 4)
        q, k, v = jnp.unstack(qkv)  # see layers.Attention
        logits = _mix_heads(jnp.einsum("bhqd,bhkd->bhqk", q * head_dim**-0.5, k), "proj_l")
        attn = layers.softmax(logits.astype(jnp.float32), axis=-1).astype(x.dtype)
        mixed = nn.Dropout(self.dropout, deterministic=not train)(_mix_heads(attn, "proj_w"))
        out = jnp.einsum("bhqk,bhkd->bhqd", mixed, v).transpose(0, 2, 1, 3).reshape(x.shape)
        return nn.Dropout(self.dropout, deterministic=not train)(_dense(dim, "proj")(out)), attn


class LayerScaleBlock(nn.Module):
    """x += gamma_1 * TalkingHeadAttn(norm1(x)); x += gamma_2 * MLP(norm2(x))."""

    num_heads: int
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    init_values: float = 1e-4
    drop_path: float = 0.0
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, train: bool):
        dim = x.shape[-1]
        init = nn.initializers.constant(self.init_values)
        gamma_1 = self.param("gamma_1", init, (dim,))
        gamma_2 = self.param("gamma_2", init, (dim,))
        drop_path = layers.DropPath(self.drop_path)
        y, attn = TalkingHeadAttn(self.num_heads, self.qkv_bias, self.dropout, name="attn")(
            _layer_norm("norm1")(x), train=train
        )
        x = x + drop_path(gamma_1 * y, train=train)
        y = layers.Mlp(int(dim * self.mlp_ratio), self.dropout, name="mlp")(
            _layer_norm("norm2")(x), train=train
        )
        return x + drop_path(gamma_2 * y, train=train), attn


class LayerScaleBlockClassAttn(nn.Module):
    """cls += gamma_1 * ClassAttn(norm1([cls; x])); cls += gamma_2 * MLP(norm2(cls));
    the patch tokens x pass unchanged (timm: no drop path here)."""

    num_heads: int
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    init_values: float = 1e-4

    @nn.compact
    def __call__(self, x, cls, *, train: bool):
        dim = x.shape[-1]
        init = nn.initializers.constant(self.init_values)
        gamma_1 = self.param("gamma_1", init, (dim,))
        gamma_2 = self.param("gamma_2", init, (dim,))
        u = _layer_norm("norm1")(jnp.concatenate([cls, x], axis=1))
        y, attn = fan.ClassAttn(self.num_heads, self.qkv_bias, name="attn")(u)
        cls = cls + gamma_1 * y
        y = layers.Mlp(int(dim * self.mlp_ratio), name="mlp")(
            _layer_norm("norm2")(cls), train=train
        )
        return cls + gamma_2 * y, attn


class CaiT(nn.Module):
    """timm `Cait` with token pooling.

    Attributes:
      init_values: LayerScale init (timm: 1e-5 at depth 24; the CaiT paper and the thesis:
        0.1 up to depth 18).
      depth_token_only: class-attention blocks (2).
      drop_path_rate: the same rate in every self-attention block (timm), none in class
        attention.
      dropout: attention, projection and MLP dropout (0 in the published recipes).
      remat: recompute each self-attention block's activations in the backward pass.
    """

    num_classes: int
    patch_size: int = 16
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    init_values: float = 1e-4
    depth_token_only: int = 2
    drop_path_rate: float = 0.0
    dropout: float = 0.0
    remat: bool = False

    no_weight_decay_names = ("pos_embed", "cls_token")  # timm no_weight_decay()

    @nn.compact
    def __call__(self, images, *, train: bool, sow_attention: bool = False):
        height, width = images.shape[1:3]
        if height % self.patch_size or width % self.patch_size:
            raise ValueError(
                f"image size {height}x{width} is not divisible by patch_size {self.patch_size}"
            )
        x = vit.PatchEmbed(self.embed_dim, self.patch_size, name="patch_embed")(images)
        batch = x.shape[0]
        x = x.reshape(batch, -1, self.embed_dim)  # row-major token order
        pos = self.param("pos_embed", layers.dense_init, (1, x.shape[1], self.embed_dim))
        x = nn.Dropout(self.dropout, deterministic=not train)(x + pos)
        block = layers.maybe_remat(LayerScaleBlock, self.remat, static_argnums=(2,))
        for i in range(self.depth):
            x, attn = block(
                self.num_heads,
                self.mlp_ratio,
                self.qkv_bias,
                self.init_values,
                self.drop_path_rate,
                self.dropout,
                name=f"blocks_{i}",
            )(x, train)
            layers.sow_block(self, x, attn, sow_attention)
        cls_token = self.param("cls_token", layers.dense_init, (1, 1, self.embed_dim))
        cls = jnp.broadcast_to(cls_token, (batch, 1, self.embed_dim))
        for i in range(self.depth_token_only):
            cls, attn = LayerScaleBlockClassAttn(
                self.num_heads,
                self.mlp_ratio,
                self.qkv_bias,
                self.init_values,
                name=f"blocks_token_only_{i}",
            )(x, cls, train=train)
            layers.sow_class_attention(self, attn, sow_attention)
        # timm normalises [cls; x] and keeps token 0: LayerNorm is per token.
        x = _layer_norm("norm")(cls[:, 0])
        x = nn.Dropout(self.dropout, deterministic=not train)(x)
        return _dense(self.num_classes, "head")(x)


def _variant(embed_dim: int, depth: int, num_heads: int, init_values: float):
    def factory(num_classes: int, **overrides) -> CaiT:
        kwargs = dict(
            embed_dim=embed_dim, depth=depth, num_heads=num_heads, init_values=init_values
        )
        kwargs.update(overrides)
        return CaiT(num_classes=num_classes, **kwargs)

    return factory


# timm's cait_xxs24_224 and cait_s24_224 (patch 16 at 224 px).
register("cait_xxs24_224")(_variant(192, 24, 4, 1e-5))
register("cait_s24_224")(_variant(384, 24, 8, 1e-5))
# The thesis's CaiT-S12: CaiT-S24 with 12 blocks, LayerScale initialised to 0.1 as the CaiT
# paper and the thesis prescribe up to depth 18 (25,611,688 parameters, its "25.61M").
register("cait_s12_224")(_variant(384, 12, 8, 0.1))
