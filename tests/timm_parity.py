"""Logits of our models vs timm's, both directions, for the timm parity tests (run as a script).

    python tests/timm_parity.py OUT_DIR deit_tiny_patch16_224 xcit_nano_12_p16_224
    python tests/timm_parity.py OUT_DIR 'cait_xxs24_224:{"depth": 2}'
    python tests/timm_parity.py OUT_DIR swin_tiny_patch4_window7_224 --shapes swin_base_patch4_window7_224

A name may carry constructor overrides as JSON after a colon, given to both libraries (our
field names follow timm's), to check a smaller member of the family. With `--shapes`, the
models named after it also have timm's state-dict keys and shapes reported (built without
memory), and the output is {'logits': {...}, 'shapes': {model: {key: shape}}}.

JAX -> timm: our randomly initialised model (every tensor perturbed off its init), exported
as a .pth that timm loads with strict=True. timm -> JAX: a randomly initialised, perturbed
timm model's state_dict() imported strictly. Prints {model: {direction: max |diff|,
'max_abs_logit': ...}} as JSON.
"""

import functools
import json
import os
import sys

import jax
import numpy as np
import timm  # before tensorflow (imported by rspc_jax): see test_interop
import torch

from rspc_jax import models
from rspc_jax.interop import state_dicts as interop

BATCH = 2


def perturbed_jax(model, seed=0):
    variables = jax.jit(functools.partial(model.init, train=False))(
        jax.random.PRNGKey(seed), np.zeros((1, 224, 224, 3), np.float32)
    )
    rng = np.random.default_rng(seed + 1)

    def move(path, leaf):  # BatchNorm variances stay positive
        noise = 0.02 * rng.normal(size=leaf.shape).astype(np.float32)
        return leaf + (np.abs(noise) if path[-1].key == "var" else noise)

    return jax.tree_util.tree_map_with_path(
        move, {c: variables[c] for c in ("params", "batch_stats") if c in variables}
    )


def perturbed_timm(name, overrides):
    model = timm.create_model(name, pretrained=False, **overrides).eval()
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.add_(0.02 * torch.randn_like(tensor))
        # BatchNorm statistics (variances stay positive); not the buffers a state dict leaves
        # out, which are constants derived from the shapes (Swin's attention masks).
        saved = set(model.state_dict())
        for key, tensor in model.named_buffers():
            if tensor.is_floating_point() and key in saved:
                tensor.add_(0.02 * torch.rand_like(tensor))
    return model


def parse(spec: str) -> tuple[str, dict]:
    name, _, overrides = spec.partition(":")
    return name, json.loads(overrides or "{}")


def state_dict_shapes(spec: str) -> dict[str, list[int]]:
    name, overrides = parse(spec)
    with torch.device("meta"):
        model = timm.create_model(name, pretrained=False, **overrides)
    return {key: list(value.shape) for key, value in model.state_dict().items()}


def max_errors(spec: str, out_dir: str, images: np.ndarray) -> dict:
    name, overrides = parse(spec)
    images_nchw = torch.from_numpy(images.transpose(0, 3, 1, 2).copy())
    model = models.create(name, num_classes=1000, **overrides)
    forward = jax.jit(functools.partial(model.apply, train=False))
    ours = perturbed_jax(model)

    path = os.path.join(out_dir, f"{name}.pth")
    interop.save_torch(path, interop.export_state_dict(ours))
    reference = timm.create_model(name, pretrained=False, **overrides).eval()
    reference.load_state_dict(torch.load(path), strict=True)
    with torch.no_grad():
        expected = reference(images_nchw).numpy()
    jax_to_timm = float(np.abs(np.asarray(forward(ours, images)) - expected).max())
    largest = float(np.abs(expected).max())

    source = perturbed_timm(name, overrides)
    with torch.no_grad():
        expected = source(images_nchw).numpy()
    path = os.path.join(out_dir, f"{name}_timm.pth")
    torch.save(source.state_dict(), path)
    imported = interop.load_checkpoint(path, ours)
    timm_to_jax = float(np.abs(np.asarray(forward(imported, images)) - expected).max())
    return {
        "jax_to_timm": jax_to_timm,
        "timm_to_jax": timm_to_jax,
        "max_abs_logit": max(largest, float(np.abs(expected).max())),
    }


def main(out_dir: str, *args: str) -> None:
    jax.config.update("jax_default_matmul_precision", "highest")
    torch.manual_seed(0)
    images = np.random.default_rng(0).normal(size=(BATCH, 224, 224, 3)).astype(np.float32)
    specs = args[: args.index("--shapes")] if "--shapes" in args else args
    logits = {spec: max_errors(spec, out_dir, images) for spec in specs}
    if "--shapes" not in args:
        print(json.dumps(logits))
        return
    shapes = {spec: state_dict_shapes(spec) for spec in args[len(specs) + 1 :]}
    print(json.dumps({"logits": logits, "shapes": shapes}))


if __name__ == "__main__":
    main(*sys.argv[1:])
