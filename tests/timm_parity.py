"""Logits of our models vs timm's, both directions, for `test_interop` (run as a script).

    python tests/timm_parity.py OUT_DIR deit_tiny_patch16_224 xcit_nano_12_p16_224

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


def perturbed_timm(name):
    model = timm.create_model(name, pretrained=False).eval()
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.add_(0.02 * torch.randn_like(tensor))
        for tensor in model.buffers():  # BatchNorm statistics; variances stay positive
            if tensor.is_floating_point():
                tensor.add_(0.02 * torch.rand_like(tensor))
    return model


def max_errors(name: str, out_dir: str, images: np.ndarray) -> dict:
    images_nchw = torch.from_numpy(images.transpose(0, 3, 1, 2).copy())
    model = models.create(name, num_classes=1000)
    forward = jax.jit(functools.partial(model.apply, train=False))
    ours = perturbed_jax(model)

    path = os.path.join(out_dir, f"{name}.pth")
    interop.save_torch(path, interop.export_state_dict(ours))
    reference = timm.create_model(name, pretrained=False).eval()
    reference.load_state_dict(torch.load(path), strict=True)
    with torch.no_grad():
        expected = reference(images_nchw).numpy()
    jax_to_timm = float(np.abs(np.asarray(forward(ours, images)) - expected).max())
    largest = float(np.abs(expected).max())

    source = perturbed_timm(name)
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


def main(out_dir: str, *names: str) -> None:
    jax.config.update("jax_default_matmul_precision", "highest")
    torch.manual_seed(0)
    images = np.random.default_rng(0).normal(size=(BATCH, 224, 224, 3)).astype(np.float32)
    print(json.dumps({name: max_errors(name, out_dir, images) for name in names}))


if __name__ == "__main__":
    main(*sys.argv[1:])
