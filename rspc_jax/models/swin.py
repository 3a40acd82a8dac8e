"""Swin Transformer (Liu et al., ICCV 2021) as timm builds it (timm `SwinTransformer`,
`swin_{tiny,small,base}_patch4_window7_224`), the second architecture the RSPC paper applies
RSPC to besides RVT/FAN and DeiT (Sec. 4: Swin-T, ImageNet-C mCE 62.0 -> 61.0).

A 4 px patch embedding, then four stages at strides 4, 8, 16 and 32 (2x2 patch merging in
front of stages 1-3). Each block attends inside non-overlapping windows of 7x7 tokens with a
learned relative position bias; every second block rolls the map by half a window first, so
that information crosses window borders, and masks the pairs that the roll brought together
from opposite image edges. Stages whose map is no larger than a window use one unshifted
window (timm). The head averages the final map after the last LayerNorm.

RSPC on this hierarchy (docs/models.md, 'Swin'): every block's output is sown as a
(B, H*W, C) token sequence at its own stage's resolution, and the alignment loss averages
the per-block mean squared differences (rspc.alignment_loss), so every stage is aligned at
its resolution and each block counts once, as the paper's mean over all attention layers.
`patch_size`, the default RSPC corruption patch, is the token size of the third stage: 16 px
(a 14x14 grid at 224), the patch the paper uses for every other model. Half the blocks of
Swin-T (18 of 24 in Swin-S/B) work at that resolution, where a corrupted patch is exactly
one token; the 4 px stem grid would make the corruption model's N x N layer 3136^2 (a third
of Swin-T's size) and occlude specks rather than patches. `config.rspc.patch_size` can
choose 4, 8 or 32 instead (any size dividing the image). The attention maps sown on request
are the window maps, (B, heads, windows, T, T) with T = 49 tokens per window.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from rspc_jax.models import layers, register

LAYERNORM_EPS = 1e-5  # timm's Swin uses torch.nn.LayerNorm's default
# timm's logit offset for token pairs that a shifted window joins across the image edge.
MASKED = -100.0


def _layer_norm(name: str) -> layers.LayerNorm:
    return layers.LayerNorm(epsilon=LAYERNORM_EPS, name=name)


def _dense(features: int, name: str, use_bias: bool = True) -> nn.Dense:
    return layers.dense(features, use_bias=use_bias, kernel_init=layers.dense_init, name=name)


def window_and_shift(grid, window_size: int, shifted: bool):
    """Per axis (window, shift) of a block on a `grid` map: a map no larger than the window
    is one window without a shift (timm `_calc_window_shift`)."""
    window = tuple(min(g, window_size) for g in grid)
    shift = tuple(w // 2 if shifted and g > w else 0 for g, w in zip(grid, window))
    return window, shift


def partition(x: jax.Array, window) -> jax.Array:
    """(B, H, W, C) -> (B, windows, T, C): windows and the tokens in each row-major."""
    batch, height, width, channels = x.shape
    rows, cols = window
    x = x.reshape(batch, height // rows, rows, width // cols, cols, channels)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(batch, -1, rows * cols, channels)


def unpartition(windows: jax.Array, grid, window) -> jax.Array:
    """Inverse of `partition`: (B, windows, T, C) -> (B, H, W, C)."""
    batch, _, _, channels = windows.shape
    (height, width), (rows, cols) = grid, window
    x = windows.reshape(batch, height // rows, width // cols, rows, cols, channels)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(batch, height, width, channels)


def relative_position_index(window) -> np.ndarray:
    """(T, T) row of the ((2h-1)(2w-1), heads) bias table for each query/key offset."""
    rows, cols = window
    coords = np.stack(np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij"), -1)
    coords = coords.reshape(-1, 2)
    offset = coords[:, None] - coords[None, :] + np.array([rows - 1, cols - 1])
    return offset[..., 0] * (2 * cols - 1) + offset[..., 1]


def shifted_window_mask(grid, window, shift) -> np.ndarray | None:
    """(windows, T, T) logit offsets of a shifted block: 0 for pairs from the same region of
    the rolled map, MASKED for pairs that the roll joined across the image edge.

    Along each axis the rolled map has three bands, [0, n - w), [n - w, n - s) and
    [n - s, n); only the last row (column) of windows straddles a band border."""
    if not any(shift):
        return None

    def bands(size, win, sft):
        index = np.arange(size)
        return (index >= size - win).astype(np.int64) + (sft > 0) * (index >= size - sft)

    region = bands(grid[0], window[0], shift[0])[:, None] * 3 + bands(grid[1], window[1], shift[1])
    region = partition(region[None, :, :, None], window)[0, :, :, 0]  # (windows, T)
    return np.where(region[:, :, None] != region[:, None, :], MASKED, 0.0).astype(np.float32)


class WindowAttention(nn.Module):
    """Multi-head self-attention inside each window, plus a learned bias per head for each
    relative offset between query and key (timm `WindowAttention`; fused `qkv` [q; k; v])."""

    num_heads: int
    window: tuple[int, int]
    qkv_bias: bool = True
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, mask: np.ndarray | None, *, train: bool):
        batch, windows, tokens, dim = x.shape
        if dim % self.num_heads:
            raise ValueError(f"width {dim} is not divisible by num_heads {self.num_heads}")
        heads, head_dim = self.num_heads, dim // self.num_heads
        rows, cols = self.window
        table = self.param(
            "relative_position_bias_table",
            layers.dense_init,
            ((2 * rows - 1) * (2 * cols - 1), heads),
        )
        bias = table[relative_position_index(self.window)].transpose(2, 0, 1)  # (heads, T, T)
        qkv = _dense(3 * dim, "qkv", self.qkv_bias)(x)
        qkv = qkv.reshape(batch, windows, tokens, 3, heads, head_dim).transpose(3, 0, 1, 4, 2, 5)
        q, k, v = jnp.unstack(qkv)  # (B, windows, heads, T, head_dim); see layers.Attention
        logits = jnp.einsum("bwhqd,bwhkd->bwhqk", q * head_dim**-0.5, k) + bias.astype(x.dtype)
        if mask is not None:
            logits = logits + jnp.asarray(mask, x.dtype)[:, None]
        attn = layers.softmax(logits.astype(jnp.float32), axis=-1).astype(x.dtype)
        attn_dropped = nn.Dropout(self.dropout, deterministic=not train)(attn)
        out = jnp.einsum("bwhqk,bwhkd->bwqhd", attn_dropped, v).reshape(x.shape)
        out = _dense(dim, "proj")(out)
        return nn.Dropout(self.dropout, deterministic=not train)(out), attn


class SwinBlock(nn.Module):
    """x += W-MSA(norm1(x)) (shifted windows when `shifted`); x += MLP(norm2(x)); NHWC."""

    num_heads: int
    window_size: int = 7
    shifted: bool = False
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    drop_path: float = 0.0
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, train: bool):
        grid = x.shape[1:3]
        window, shift = window_and_shift(grid, self.window_size, self.shifted)
        if any(g % w for g, w in zip(grid, window)):
            raise ValueError(
                f"a {grid[0]}x{grid[1]} token map does not split into {window[0]}x{window[1]} "
                "windows (timm pads it; not supported here): use an image size whose stage "
                "maps are multiples of the window or no larger than it (224 with window 7)"
            )
        drop_path = layers.DropPath(self.drop_path)
        y = _layer_norm("norm1")(x)
        if any(shift):
            y = jnp.roll(y, (-shift[0], -shift[1]), axis=(1, 2))
        y, attn = WindowAttention(self.num_heads, window, self.qkv_bias, self.dropout, name="attn")(
            partition(y, window), shifted_window_mask(grid, window, shift), train=train
        )
        y = unpartition(y, grid, window)
        if any(shift):
            y = jnp.roll(y, shift, axis=(1, 2))
        x = x + drop_path(y, train=train)
        y = layers.Mlp(int(x.shape[-1] * self.mlp_ratio), self.dropout, name="mlp")(
            _layer_norm("norm2")(x), train=train
        )
        return x + drop_path(y, train=train), attn


class PatchMerging(nn.Module):
    """Each 2x2 group of tokens concatenated (timm's channel order: column offset, then row
    offset, then channel), normalised and projected to `features` without bias."""

    features: int

    @nn.compact
    def __call__(self, x):
        batch, height, width, channels = x.shape
        if height % 2 or width % 2:
            raise ValueError(
                f"patch merging needs an even token map, got {height}x{width} (timm pads it; "
                "not supported here): use an image size of 32 * 7 * k px or another size whose "
                "stage maps stay even"
            )
        x = x.reshape(batch, height // 2, 2, width // 2, 2, channels).transpose(0, 1, 3, 4, 2, 5)
        x = x.reshape(batch, height // 2, width // 2, 4 * channels)
        return _dense(self.features, "reduction", use_bias=False)(_layer_norm("norm")(x))


class SwinStage(nn.Module):
    """timm `SwinTransformerStage`: optional patch merging, then blocks alternating unshifted
    and shifted windows. Returns the stage output and each block's (output, attention)."""

    dim: int
    depth: int
    num_heads: int
    window_size: int
    downsample: bool
    drop_paths: tuple[float, ...]
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    dropout: float = 0.0
    remat: bool = False

    @nn.compact
    def __call__(self, x, train: bool):
        if self.downsample:
            x = PatchMerging(self.dim, name="downsample")(x)
        block = layers.maybe_remat(SwinBlock, self.remat, static_argnums=(2,))
        outputs = []
        for i in range(self.depth):
            x, attn = block(
                self.num_heads,
                self.window_size,
                i % 2 == 1,
                self.mlp_ratio,
                self.qkv_bias,
                self.drop_paths[i],
                self.dropout,
                name=f"blocks_{i}",
            )(x, train)
            outputs.append((x, attn))
        return x, outputs


class PatchEmbed(nn.Module):
    """timm `PatchEmbed` with a LayerNorm: conv with kernel = stride = patch, then `norm`."""

    width: int
    patch_size: int

    @nn.compact
    def __call__(self, images):
        fan_in = images.shape[-1] * self.patch_size**2
        x = layers.Conv(
            self.width,
            self.patch_size,
            self.patch_size,
            **layers.linear_init(fan_in, torch_init=True),
            name="proj",
        )(images)
        return _layer_norm("norm")(x)


class Swin(nn.Module):
    """timm `SwinTransformer` with average pooling.

    Attributes:
      embed_patch_size: the stem's patch (timm `patch_size`, 4).
      embed_dim: stage-0 width; stage i has embed_dim * 2**i channels and num_heads[i] heads.
      window_size: tokens per window side (timm 7).
      drop_path_rate: stochastic depth rising linearly over all blocks from 0 (timm).
      dropout: attention, projection and MLP dropout (timm drop rates; 0 in its recipes).
      remat: recompute each block's activations in the backward pass.
    """

    num_classes: int
    embed_patch_size: int = 4
    embed_dim: int = 96
    depths: tuple[int, ...] = (2, 2, 6, 2)
    num_heads: tuple[int, ...] = (3, 6, 12, 24)
    window_size: int = 7
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    drop_path_rate: float = 0.0
    dropout: float = 0.0
    remat: bool = False

    no_weight_decay_names = ("relative_position_bias_table",)  # timm no_weight_decay()

    @property
    def patch_size(self) -> int:
        """The default RSPC patch: one token of the third stage (16 px for Swin-T/S/B)."""
        return self.embed_patch_size * 2 ** min(2, len(self.depths) - 1)

    @nn.compact
    def __call__(self, images, *, train: bool, sow_attention: bool = False):
        if len(self.depths) != len(self.num_heads):
            raise ValueError(
                f"depths {self.depths} and num_heads {self.num_heads} differ in length"
            )
        height, width = images.shape[1:3]
        if height % self.embed_patch_size or width % self.embed_patch_size:
            raise ValueError(
                f"image size {height}x{width} is not divisible by the patch embedding's "
                f"{self.embed_patch_size} px"
            )
        x = PatchEmbed(self.embed_dim, self.embed_patch_size, name="patch_embed")(images)
        rates = layers.drop_path_rates(self.drop_path_rate, sum(self.depths))
        first = 0
        for i, (depth, heads) in enumerate(zip(self.depths, self.num_heads)):
            x, outputs = SwinStage(
                self.embed_dim * 2**i,
                depth,
                heads,
                self.window_size,
                downsample=i > 0,
                drop_paths=tuple(rates[first : first + depth]),
                mlp_ratio=self.mlp_ratio,
                qkv_bias=self.qkv_bias,
                dropout=self.dropout,
                remat=self.remat,
                name=f"layers_{i}",
            )(x, train)
            first += depth
            for out, attn in outputs:
                tokens = out.reshape(out.shape[0], -1, out.shape[-1])
                layers.sow_block(self, tokens, attn.swapaxes(1, 2), sow_attention)
        x = _layer_norm("norm")(x).mean(axis=(1, 2))
        x = nn.Dropout(self.dropout, deterministic=not train)(x)
        return ClassifierHead(self.num_classes, name="head")(x)


class ClassifierHead(nn.Module):
    """timm `ClassifierHead`'s classifier (`head.fc`); the pooling happens before it."""

    num_classes: int

    @nn.compact
    def __call__(self, x):
        return _dense(self.num_classes, "fc")(x)


def _variant(embed_dim: int, depths: tuple[int, ...], num_heads: tuple[int, ...]):
    def factory(num_classes: int, **overrides) -> Swin:
        kwargs = dict(embed_dim=embed_dim, depths=depths, num_heads=num_heads)
        kwargs.update(overrides)
        for key in ("depths", "num_heads"):  # from configs as lists
            kwargs[key] = tuple(kwargs[key])
        return Swin(num_classes=num_classes, **kwargs)

    return factory


# timm's swin_{tiny,small,base}_patch4_window7_224.
register("swin_tiny_patch4_window7_224")(_variant(96, (2, 2, 6, 2), (3, 6, 12, 24)))
register("swin_small_patch4_window7_224")(_variant(96, (2, 2, 18, 2), (3, 6, 12, 24)))
register("swin_base_patch4_window7_224")(_variant(128, (2, 2, 18, 2), (4, 8, 16, 32)))
