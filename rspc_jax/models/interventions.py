"""Inference-time interventions on any registered model, as options of the model call:
lesions (residual branches of chosen blocks set to zero) and additive attention masks.

They work by intercepting module calls (flax `nn.intercept_methods`) rather than by new
arguments threaded through every model, so the models stay as trained and exported, and
the evaluation suites and analyses can apply them to any checkpoint. Both options are
arrays, so one compiled step serves every lesion and every mask of the same shapes.

Blocks are numbered in forward order, as their outputs are sown (`block_outputs`).
"""

from collections.abc import Sequence
import dataclasses

import flax.linen as nn
import jax
import numpy as np

from rspc_jax.models import cait, fan, layers, rvt, swin, xcit

# The backbone blocks whose outputs the models sow (not stem or class-attention blocks).
BLOCK_TYPES = (
    layers.Block,
    rvt.Block,
    fan.FANBlock,
    xcit.XCABlock,
    swin.SwinBlock,
    cait.LayerScaleBlock,
)
# Residual-branch submodules of a block, by name: self-attention, XCiT's local patch
# interaction, MLP (FAN: channel processing). Columns of `Intervention.keep`.
BRANCHES = ("attn", "local_mp", "mlp")
# Attention modules that attend between tokens and so accept an additive (N, N) bias.
TOKEN_ATTENTION_TYPES = (layers.Attention, fan.TokenMixing)
# A logit bias that removes a pair from the softmax but keeps it finite (no NaN rows).
MASKED = -1e9


def branch_names(model: nn.Module) -> tuple[str, ...]:
    """The residual branches each block of `model` has, in BRANCHES order."""
    return BRANCHES if isinstance(model, xcit.XCiT) else ("attn", "mlp")


def num_prefix_tokens(model: nn.Module) -> int:
    """Tokens before the patch grid in the blocks' sequence (ViT's class token)."""
    return 1 if getattr(model, "pool", None) == "token" else 0


@dataclasses.dataclass(frozen=True)
class Intervention:
    """keep: (num_blocks, len(BRANCHES)) multipliers of each residual branch (1 keeps it,
    0 removes it: the block then passes its input through the skip connection).
    attention_bias: one (N, N) additive logit bias per block (None leaves it as is)."""

    keep: jax.Array | None = None
    attention_bias: Sequence[jax.Array | None] | None = None


jax.tree_util.register_dataclass(
    Intervention, data_fields=["keep", "attention_bias"], meta_fields=[]
)


def keep_all(num_blocks: int) -> np.ndarray:
    return np.ones((num_blocks, len(BRANCHES)), np.float32)


def apply(model: nn.Module, variables, images, intervention: Intervention, **kwargs):
    """`model.apply(variables, images, **kwargs)` with `intervention` in force."""
    if getattr(model, "scan_blocks", False):
        # The scan traces one block for all, so per-block interception cannot tell them apart.
        raise ValueError(
            "interventions (lesions, attention masks) need the blocks unrolled: "
            "set config.scan_blocks=False (the parameters are the same, so any "
            "checkpoint of the scanned model loads)"
        )
    block_index = {}  # block path -> forward-order index (remat may call a block twice)
    enclosing = []  # (index, path) of the block being called

    def interceptor(next_fun, args, call_kwargs, context):
        module = context.module
        if context.method_name != "__call__":
            return next_fun(*args, **call_kwargs)
        if isinstance(module, BLOCK_TYPES):
            index = block_index.setdefault(module.path, len(block_index))
            enclosing.append((index, module.path))
            try:
                return next_fun(*args, **call_kwargs)
            finally:
                enclosing.pop()
        if not enclosing or module.path[:-1] != enclosing[-1][1] or module.name not in BRANCHES:
            return next_fun(*args, **call_kwargs)
        index = enclosing[-1][0]
        bias = intervention.attention_bias[index] if intervention.attention_bias else None
        if module.name == "attn" and bias is not None:
            if not isinstance(module, TOKEN_ATTENTION_TYPES):
                raise ValueError(
                    f"{type(module).__name__} does not attend between tokens (XCiT's XCA attends "
                    "between channels), so an attention mask over patches does not apply to it"
                )
            call_kwargs = {**call_kwargs, "bias": bias}
        out = next_fun(*args, **call_kwargs)
        if intervention.keep is None:
            return out
        scale = intervention.keep[index, BRANCHES.index(module.name)]
        if module.name == "attn":  # (branch output, attention map)
            return (out[0] * scale.astype(out[0].dtype),) + tuple(out[1:])
        return out * scale.astype(out.dtype)

    with nn.intercept_methods(interceptor):
        return model.apply(variables, images, **kwargs)
