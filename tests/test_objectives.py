"""The objectives' registry (training/objectives.py): names, the common signature, and that
each registered objective trains through the step."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rspc_jax import ConfigError, parallel, rspc
from rspc_jax.data import on_device
from rspc_jax.data import specs as datasets
from rspc_jax.training import checks, mixup, objectives, setup
from tests.conftest import first_batches, smoke_config

COMMON_SIGNATURE = [
    "ctx",
    "params",
    "corruption_params",
    "mask_probe",
    "batch_stats",
    "images",
    "noise_rng",
    "rngs",
]

# The config switches that select each objective of the registry.
SELECTED_BY = {
    "rspc": {},
    "plain": {"rspc.enabled": False},
    "adversarial": {"rspc.enabled": False, "adversarial.method": "fgsm"},
}


def test_an_unknown_objective_is_refused_with_the_closest_names():
    with pytest.raises(ConfigError, match=r"unknown objective 'rspcc'\. Did you mean rspc\?"):
        objectives.get("rspcc")
    with pytest.raises(ConfigError) as refused:
        objectives.get("zzz")
    registered = ", ".join(sorted(objectives.OBJECTIVES))
    assert str(refused.value) == f"unknown objective 'zzz'. Registered objectives: {registered}."


def test_the_config_switches_select_each_registered_objective(digits_data_dir):
    spec = datasets.dataset_spec("sklearn_digits")
    assert set(SELECTED_BY) == set(objectives.OBJECTIVES)
    for name, overrides in SELECTED_BY.items():
        settings = setup.step_settings(smoke_config(digits_data_dir, **overrides), spec)
        assert objectives.name_of(settings) == name


def test_the_selections_the_config_accepts_are_the_registered_ones():
    """checks.py (no JAX) lists the values of rspc.selection; rspc.SELECTIONS implements them."""
    assert checks.CHOICES["rspc.selection"] == tuple(rspc.SELECTIONS)


def test_step_settings_hold_rspc_s_settings_whole(digits_data_dir):
    """The step's settings carry RSPC's as rspc.py resolves them, in one field."""
    config = smoke_config(digits_data_dir, **{"rspc.corruption_diversity": 0.5})
    spec = datasets.dataset_spec("sklearn_digits")
    settings = setup.step_settings(config, spec, steps_per_epoch=10)
    assert settings.rspc == rspc.settings_from_config(config, spec, steps_per_epoch=10)
    assert settings.rspc.diversity == 0.5 and settings.rspc.selection == "learned"


def _context(config, batch):
    """A Context over `batch` whose settings serve every objective (RSPC and an attack)."""
    spec = datasets.dataset_spec(config.dataset)
    model = setup.build_model(config, spec.num_classes)
    corruption_model = rspc.make_corruption_model(
        config.rspc, rspc.corruption_patch_size(config.rspc, model)
    )
    images = on_device.prepared(batch, spec.mean, spec.std)  # as the step takes them
    ctx = objectives.Context(
        model=model,
        corruption_model=corruption_model,
        settings=setup.step_settings(config, spec),
        step=jnp.zeros((), jnp.int32),
        select_rng=jax.random.PRNGKey(3),
        targets=mixup.one_hot_smoothed(batch["label"], spec.num_classes, 0.1),
        example_ids=jnp.arange(images.shape[0]),
    )
    variables = model.init(jax.random.PRNGKey(0), images, train=False)
    corruption_params = corruption_model.init(jax.random.PRNGKey(1), images)["params"]
    return ctx, images, variables, corruption_params


@pytest.mark.parametrize("name", sorted(objectives.OBJECTIVES))
def test_every_objective_has_the_common_signature_and_a_finite_gradient(digits_data_dir, name):
    objective = objectives.get(name)
    assert list(inspect.signature(objective.loss).parameters) == COMMON_SIGNATURE
    config = smoke_config(digits_data_dir, batch_size=8, **{"adversarial.method": "fgsm"})
    ctx, images, variables, corruption_params = _context(config, first_batches(config)[0])
    extra = ({}, None)
    if objective.extra_inputs is not None:
        extra = objective.extra_inputs(ctx, corruption_params, images)

    def loss(params, *extra):
        return objective.loss(
            ctx,
            params,
            *extra,
            variables.get("batch_stats", {}),
            images,
            jax.random.PRNGKey(4),
            {"dropout": jax.random.PRNGKey(5)},
        )

    argnums = (0, 1, 2) if objective.extra_inputs is not None else 0
    (value, aux), grads = jax.value_and_grad(loss, argnums=argnums, has_aux=True)(
        variables["params"], *extra
    )
    grads = grads if objective.extra_inputs is not None else (grads, {}, None)
    assert np.isfinite(value) and np.isfinite(aux["ce"])
    assert aux["logits"].shape == (images.shape[0], ctx.settings.num_classes)
    norm = float(jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads[0]))))
    assert np.isfinite(norm) and norm > 0
    metrics, chosen = objective.metrics(ctx, images, aux, grads[2])
    assert all(np.isfinite(v) for v in metrics.values())
    for mask in chosen.values():
        assert mask.shape[0] == images.shape[0]


@pytest.mark.parametrize("name", sorted(SELECTED_BY))
def test_each_objective_takes_a_finite_step_that_moves_what_it_trains(digits_data_dir, name):
    config = smoke_config(digits_data_dir, batch_size=8, **SELECTED_BY[name])
    spec = datasets.dataset_spec(config.dataset)
    mesh = parallel.create_mesh()
    parts = setup.build(
        config, setup.build_model(config, spec.num_classes), spec, mesh, 10, total_steps=10
    )
    state = parts.init(jax.random.PRNGKey(0))
    before = jax.device_get(state)
    state, metrics = parts.train_step(state, parallel.to_global(first_batches(config)[0], mesh))
    after = jax.device_get(state)
    assert np.isfinite(metrics["loss"]) and metrics["nonfinite"] == 0

    def changed(tree_a, tree_b):
        return any(
            not np.array_equal(a, b)
            for a, b in zip(jax.tree.leaves(tree_a), jax.tree.leaves(tree_b), strict=True)
        )

    assert changed(before.params, after.params)
    trains_c = objectives.get(name).extra_inputs is not None
    assert bool(jax.tree.leaves(after.corruption_params)) == trains_c
    if trains_c:
        assert changed(before.corruption_params, after.corruption_params)
