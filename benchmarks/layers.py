"""Forward+backward time of a ViT block's parts, ours (flax on XLA) beside timm's (PyTorch),
in one process: which layer a train step's gap to PyTorch comes from.

    python -m benchmarks.layers --batch=8 --steps=10
    python -m benchmarks.layers --width=192 --heads=3 --model=deit_tiny_patch16_224

Parts: LayerNorm, attention (qkv, softmax attention, projection), MLP (fc1, exact GELU,
fc2), a whole block (drop path 0.1), and with --model the whole model (our registered model
against timm's of the same name, train mode). Each is the gradient of sum(output^2) with
respect to the input and every parameter. Ours and timm's alternate for --rounds rounds of
--steps steps each and the table gives the medians over all of them (the machine's drift
stays out of the ratio); torch uses every core, as XLA does.
"""

import statistics

from absl import flags
import flax.linen as nn
import jax
import jax.numpy as jnp

from benchmarks import timing
from rspc_jax import models
from rspc_jax.models import layers
from rspc_jax.tools import cli

_BATCH = flags.DEFINE_integer("batch", 8, "Sequences (images) per step.", lower_bound=1)
_TOKENS = flags.DEFINE_integer(
    "tokens", 197, "Tokens per sequence (DeiT at 224 px: 197).", lower_bound=1
)
_WIDTH = flags.DEFINE_integer("width", 384, "Token width (DeiT-S: 384).", lower_bound=1)
_HEADS = flags.DEFINE_integer("heads", 6, "Attention heads (DeiT-S: 6).", lower_bound=1)
_MODEL = flags.DEFINE_string(
    "model", "deit_small_patch16_224", "Also a whole model ('' = the block's parts only)."
)
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per part and round.", lower_bound=1)
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Rounds alternating ours and timm's.", lower_bound=1)


class _Part(nn.Module):
    """One block part, applied to (B, N, width) tokens."""

    part: str
    heads: int

    @nn.compact
    def __call__(self, x):
        width = x.shape[-1]
        if self.part == "layernorm":
            return layers.LayerNorm(epsilon=1e-6)(x)
        if self.part == "attention":
            return layers.Attention(self.heads)(x, train=True)[0]
        if self.part == "mlp":
            return layers.Mlp(4 * width)(x, train=True)
        return layers.Block(self.heads, 4 * width, drop_path=0.1)(x, train=True)[0]


def _our_step(module: nn.Module, inputs: jax.Array, model_call: bool):
    """A blocking call of the compiled gradient of sum(output^2) w.r.t. input and params."""
    rngs = {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}
    kwargs = {"train": False} if model_call else {}
    variables = module.init(rngs, inputs, **kwargs)

    def loss(params, x):
        kwargs = {"train": True} if model_call else {}
        out = module.apply(
            {**variables, "params": params},
            x,
            rngs={"dropout": jax.random.PRNGKey(2)},
            mutable=["batch_stats"],
            **kwargs,
        )[0]
        return jnp.sum(jnp.square(out))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(variables["params"], inputs).compile()
    return lambda: jax.block_until_ready(grad(variables["params"], inputs))


def _timm_step(module, inputs):
    """The same gradient in PyTorch (train mode), one call per step."""
    module.train()
    parameters = list(module.parameters())

    def step():
        inputs.grad = None
        for p in parameters:
            p.grad = None
        module(inputs).square().sum().backward()

    return step


def compare(
    *, batch: int, tokens: int, width: int, heads: int, model: str, steps: int, rounds: int
) -> dict:
    """part -> (our median seconds, timm's median seconds)."""
    try:
        import timm
        from timm.layers import Mlp
        from timm.models.vision_transformer import Attention, Block
        import torch
    except ImportError as error:
        raise SystemExit(
            f"timm and torch are needed ({error}); pip install -r requirements-torch.txt"
        ) from None
    if model and not timm.is_model(model):
        raise SystemExit(f"--model={model} is not a timm model; use a ViT/DeiT or XCiT name")
    torch.set_num_threads(timing.usable_cores())
    torch.manual_seed(0)
    tokens_in = jax.random.normal(jax.random.PRNGKey(3), (batch, tokens, width))
    torch_tokens = torch.randn(batch, tokens, width, requires_grad=True)
    timm_parts = {
        "layernorm": torch.nn.LayerNorm(width, eps=1e-6),
        "attention": Attention(width, heads, qkv_bias=True),
        "mlp": Mlp(width, 4 * width),
        "block": Block(width, heads, qkv_bias=True, drop_path=0.1),
    }
    steps_of = {
        part: (
            _our_step(_Part(part, heads), tokens_in, model_call=False),
            _timm_step(module, torch_tokens),
        )
        for part, module in timm_parts.items()
    }
    if model:
        images = jax.random.normal(jax.random.PRNGKey(4), (batch, 224, 224, 3))
        torch_images = torch.randn(batch, 3, 224, 224, requires_grad=True)
        steps_of[model] = (
            _our_step(models.create(model, num_classes=1000), images, model_call=True),
            _timm_step(timm.create_model(model, drop_path_rate=0.1), torch_images),
        )
    samples = {part: ([], []) for part in steps_of}
    for _ in range(rounds):
        for part, (ours, theirs) in steps_of.items():
            for step, sample in ((ours, samples[part][0]), (theirs, samples[part][1])):
                step()  # warm-up: first call of the round
                sample.extend(timing.time_calls(step, steps)[0])
    return {
        part: (statistics.median(ours), statistics.median(theirs))
        for part, (ours, theirs) in samples.items()
    }


def main(argv):
    cli.start(argv)
    results = compare(
        batch=_BATCH.value,
        tokens=_TOKENS.value,
        width=_WIDTH.value,
        heads=_HEADS.value,
        model=_MODEL.value,
        steps=_STEPS.value,
        rounds=_ROUNDS.value,
    )
    print(
        f"forward+backward, batch {_BATCH.value} x {_TOKENS.value} tokens x {_WIDTH.value}, "
        f"{_HEADS.value} heads, float32, {jax.devices()[0].device_kind}; medians of "
        f"{_ROUNDS.value} alternating rounds of {_STEPS.value} steps"
    )
    print(f"{'part':<26} {'ours ms':>9} {'timm ms':>9} {'ours / timm':>12}")
    for part, (ours, theirs) in results.items():
        print(f"{part:<26} {1e3 * ours:>9.3f} {1e3 * theirs:>9.3f} {ours / theirs:>12.2f}")


if __name__ == "__main__":
    cli.run(main)
