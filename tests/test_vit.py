"""ViT/DeiT: parameter counts of the full-size DeiT models against timm's."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rspc_jax import models
from tests.conftest import FIXTURES


@pytest.mark.parametrize("name", ["deit_tiny_patch16_224", "deit_small_patch16_224",
                                  "deit_base_patch16_224"])
def test_deit_parameter_count_equals_timm(name):
    path = FIXTURES.parent / "torch_keys" / "params.json"
    if not path.is_file():
        pytest.skip(f"{path} is not available")
    expected = json.loads(path.read_text())["models"][name]["num_parameters"]
    model = models.create(name, num_classes=1000)
    images = jax.ShapeDtypeStruct((1, 224, 224, 3), jnp.float32)
    params = jax.eval_shape(functools.partial(model.init, train=False), jax.random.PRNGKey(0),
                            images)["params"]
    assert sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params)) == expected
