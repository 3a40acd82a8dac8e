"""ViT / DeiT (timm `VisionTransformer` semantics), plus small-image variants.

Parameter names follow timm's PyTorch attributes (`patch_embed/proj`, `cls_token`,
`pos_embed`, `blocks_{i}/{norm1,attn/qkv,attn/proj,norm2,mlp/fc1,mlp/fc2}`, `norm`,
`fc_norm`, `head`) so that export to a timm state dict is a rename plus layout rules.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from rspc_jax.models import layers, register


class PatchEmbed(nn.Module):
    """timm `PatchEmbed`: one conv with kernel = stride = patch size (`patch_embed.proj`)."""

    width: int
    patch_size: int

    @nn.compact
    def __call__(self, images):
        return layers.Conv(self.width, self.patch_size, self.patch_size, name="proj")(images)


class ViT(nn.Module):
    """Vision transformer classifier.

    Attributes:
      stem: 'patch' = one conv with kernel = stride = patch_size (ViT/DeiT);
        'conv' = log2(patch_size) stride-2 3x3 convs (an early-convolution stem,
        Xiao et al. 2021) that trains far better on tiny images such as the demo.
      pool: 'token' = final norm then class token (DeiT); 'avg' = mean of patch
        tokens then `fc_norm` (timm global_pool='avg', no class token).
      remat: recompute each block's activations in the backward pass.
      scan_blocks: run the blocks as one `lax.scan` over their stacked parameters, so
        XLA compiles one block instead of `depth` (compile time; see `_scanned_blocks`).

    `token_keep` (B, patches) of the call keeps (1) or drops (0) patch tokens: dropped
    tokens are no key of any attention and leave the mean pool, so the kept tokens see
    exactly the shorter sequence (RSPC's token-dropping ablation; the class token stays).
    """

    num_classes: int
    patch_size: int = 16
    width: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_ratio: float = 4.0
    stem: str = "patch"
    pool: str = "token"
    drop_path_rate: float = 0.0
    dropout: float = 0.0
    layernorm_eps: float = 1e-6
    remat: bool = False
    scan_blocks: bool = False

    no_weight_decay_names = ("pos_embed", "cls_token")
    supports_token_dropping = True  # blocks act on a token set: no convolution on the grid

    def _embed(self, images):
        if self.stem == "patch":
            return PatchEmbed(self.width, self.patch_size, name="patch_embed")(images)
        if self.stem == "conv":
            num_convs = int(math.log2(self.patch_size))
            if 2**num_convs != self.patch_size:
                raise ValueError(
                    f"stem='conv' needs a power-of-two patch_size, got {self.patch_size}"
                )
            x = images
            for i in range(num_convs):
                channels = self.width // 2 ** (num_convs - 1 - i)
                x = layers.Conv(channels, 3, strides=2, padding=1, name=f"stem_conv{i}")(x)
                if i < num_convs - 1:
                    x = layers.gelu(x)
            return x
        raise ValueError(f"unknown stem {self.stem!r}; use 'patch' or 'conv'")

    @nn.compact
    def __call__(
        self,
        images,
        *,
        train: bool,
        sow_attention: bool = False,
        token_keep: jax.Array | None = None,
    ):
        height, width = images.shape[1:3]
        if height % self.patch_size or width % self.patch_size:
            raise ValueError(
                f"image size {height}x{width} is not divisible by patch_size "
                f"{self.patch_size}; pick an image size that is a multiple of it"
            )
        x = self._embed(images)
        batch, grid_h, grid_w, _ = x.shape
        x = x.reshape(batch, grid_h * grid_w, self.width)  # row-major token order
        if self.pool == "token":
            cls = self.param("cls_token", nn.initializers.normal(1e-6), (1, 1, self.width))
            x = jnp.concatenate([jnp.broadcast_to(cls, (batch, 1, self.width)), x], axis=1)
        elif self.pool != "avg":
            raise ValueError(f"unknown pool {self.pool!r}; use 'token' or 'avg'")
        pos = self.param(
            "pos_embed", nn.initializers.truncated_normal(0.02), (1, x.shape[1], self.width)
        )
        x = nn.Dropout(self.dropout, deterministic=not train)(x + pos)
        if token_keep is not None and self.pool == "token":
            token_keep = jnp.concatenate([jnp.ones_like(token_keep[:, :1]), token_keep], axis=1)

        mlp_dim = int(self.width * self.mlp_ratio)
        rates = layers.drop_path_rates(self.drop_path_rate, self.depth)
        if self.scan_blocks and not self.is_initializing():
            x = self._scanned_blocks(x, rates, mlp_dim, train, token_keep, sow_attention)
        else:
            block = layers.maybe_remat(layers.Block, self.remat, static_argnums=(2,))
            for i, rate in enumerate(rates):
                x, attn = block(
                    self.num_heads,
                    mlp_dim,
                    drop_path=rate,
                    dropout=self.dropout,
                    layernorm_eps=self.layernorm_eps,
                    maps_unused=not sow_attention,
                    name=f"blocks_{i}",
                )(x, train, token_keep)
                layers.sow_block(self, x, attn, sow_attention)

        if self.pool == "token":
            x = layers.LayerNorm(epsilon=self.layernorm_eps, name="norm")(x)[:, 0]
        elif token_keep is None:
            x = layers.LayerNorm(epsilon=self.layernorm_eps, name="fc_norm")(x.mean(axis=1))
        else:
            keep = token_keep[..., None].astype(x.dtype)
            x = layers.LayerNorm(epsilon=self.layernorm_eps, name="fc_norm")(
                (x * keep).sum(axis=1) / keep.sum(axis=1)
            )
        return layers.dense(self.num_classes, kernel_init=layers.dense_init, name="head")(x)

    def _scanned_blocks(self, x, rates, mlp_dim, train, token_keep, sow_attention):
        """The blocks as one `lax.scan` of a single block over their stacked parameters.

        Written with `lax.scan` over the stored `blocks_{i}` rather than `nn.scan`, which
        would store the parameters stacked: this way checkpoints, export, the optimizer's
        weight-decay mask and interventions see the same tree with the option on or off,
        and a run can switch it at any time. Init runs the unrolled blocks. Each block's
        dropout/drop-path key is the model's key folded with the block index, so the masks
        differ from the unrolled model's (the same distribution). The price is one copy of the
        block parameters into the stack per call."""
        params = [self.variables["params"][f"blocks_{i}"] for i in range(self.depth)]
        stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *params)
        dropout_key = self.make_rng("dropout") if train else None
        # A rate of exactly 0 skips drop path; a traced per-block rate cannot.
        varying_rate = self.drop_path_rate > 0

        def body(carry, layer):
            block_params, rate, index = layer
            block = layers.Block(
                self.num_heads,
                mlp_dim,
                drop_path=rate if varying_rate else 0.0,
                dropout=self.dropout,
                layernorm_eps=self.layernorm_eps,
                maps_unused=not sow_attention,
                parent=None,
            )
            rngs = {"dropout": jax.random.fold_in(dropout_key, index)} if train else {}
            out, attn = block.apply({"params": block_params}, carry, train, token_keep, rngs=rngs)
            return out, (out, attn if sow_attention else None)

        if self.remat:
            body = jax.checkpoint(body)
        _, (outputs, attention) = jax.lax.scan(
            body, x, (stacked, jnp.asarray(rates, jnp.float32), jnp.arange(self.depth))
        )
        for i in range(self.depth):
            layers.sow_block(
                self, outputs[i], None if attention is None else attention[i], sow_attention
            )
        return outputs[-1]


def _variant(width: int, depth: int, num_heads: int, patch_size: int, **defaults) -> callable:
    def factory(num_classes: int, **overrides) -> ViT:
        kwargs = dict(width=width, depth=depth, num_heads=num_heads, patch_size=patch_size)
        kwargs.update(defaults)
        kwargs.update(overrides)
        return ViT(num_classes=num_classes, **kwargs)

    return factory


# DeiT shapes at 224x224 (Touvron et al. 2021; timm deit_*_patch16_224).
register("deit_tiny_patch16_224")(_variant(192, 12, 3, 16))
register("deit_small_patch16_224")(_variant(384, 12, 6, 16))
register("deit_base_patch16_224")(_variant(768, 12, 12, 16))
# Small-image variants (e.g. CIFAR at 32x32): same widths, patch size 4 by default,
# override with `patch_size=...`.
register("vit_tiny")(_variant(192, 12, 3, 4))
register("vit_small")(_variant(384, 12, 6, 4))
register("vit_base")(_variant(768, 12, 12, 4))
# The embedded demo: a 4-block ViT with a conv stem on 32x32 digits: 4x4 tokens of
# 8x8 pixels (2x2 original digit pixels), 0.5M params.
register("vit_demo")(_variant(96, 4, 4, 8, stem="conv", pool="avg"))
