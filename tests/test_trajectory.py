"""Our training replayed against recorded steps of the official RSPC training.

A fixture case of kind rspc_trajectory (reference/make_fixtures.py writes it with
reference/trajectory.py's comparison; docs/testing.md) holds the official initial weights of
a tiny RVT and its C, each step's examples of scikit-learn's digits, and the official float32
run's per-step CE, alignment loss, total loss, gradient norms, learning rate and masks, its
final weights, and the envelope: how far the same run in float64 lies from it at each step,
which is what rounding alone produces. Ours starts from the same weights (through interop)
and trains on the same examples with its own step; the noise tensors are ours on both sides.
Every quantity must stay within ENVELOPE_FACTOR times the envelope (its running maximum,
floored at FLOOR), and every image's mask must be the official one while the envelope's
masks still agree.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rspc_jax import parallel, rspc
from rspc_jax.data import sklearn_digits
from rspc_jax.data import specs as data_specs
from rspc_jax.interop import state_dicts as interop
from rspc_jax.training import defaults, setup
from tests.conftest import fixture_cases, load_case

ENVELOPE_FACTOR = 10.0
FLOOR = 1e-7  # float32 rounding of one value: the envelope of quantities both compute alike
SCALARS = ("ce", "align", "loss", "grad_norm", "c_grad_norm", "lr")


def _official_start(state, case):
    """`state` with the case's official initial classifier and C."""
    with (
        np.load(case.state_dict()) as classifier,
        np.load(case.path / "occlusion_state_dict.npz") as c,
    ):
        classifier, c = dict(classifier), dict(c)
    variables = interop.load_variables(
        classifier,
        dict(params=state.params, batch_stats=state.batch_stats),
        source="official",
    )
    c_params = interop.load_variables(
        c,
        dict(params=state.corruption_params),
        source="official C",
    )["params"]
    return state.replace(
        params=variables["params"], batch_stats=variables["batch_stats"], corruption_params=c_params
    )


@pytest.fixture(scope="module", params=fixture_cases("rspc_trajectory"))
def replay(request):
    """(case, our per-step records, our final state dicts in the official layout)."""
    case = load_case(request.param, "rspc_trajectory")
    config = defaults.get_default_config()
    config.update_from_flattened_dict(case.config["our_config"])
    spec = data_specs.dataset_spec("sklearn_digits")
    images, labels = sklearn_digits.upsampled_train_arrays(config.image_size, spec.mean, spec.std)
    steps_per_epoch = len(images) // config.batch_size
    model = setup.build_model(config, case.config["num_classes"])
    corruption = rspc.make_corruption_model(config.rspc, config.rspc.patch_size)
    mesh = parallel.create_mesh()
    parts = setup.build(config, model, spec, mesh, steps_per_epoch, config.total_steps)
    state = _official_start(parts.init(jax.random.PRNGKey(case.config["trajectory_seed"])), case)
    keep = jax.jit(lambda p, x: rspc.keep_mask(corruption.apply({"params": p}, x), config.rspc.rho))
    records = []
    for index in case.inputs["batch_indices"]:
        batch = dict(image=jnp.asarray(images[index]), label=jnp.asarray(labels[index]))
        masks = np.asarray(keep(state.corruption_params, batch["image"]), np.int8)
        state, metrics = parts.train_step(state, batch)
        records.append(dict(jax.device_get(metrics), masks=masks))
    blocks = case.config["num_blocks"]
    ours = {
        # The official FeatureAlignmentLoss divides by n_blocks + 1e-4, ours by n_blocks.
        "align": [float(r["align"]) * blocks / (blocks + 1e-4) for r in records],
        "c_grad_norm": [float(r["corruption_grad_norm"]) for r in records],
        **{k: [float(r[k]) for r in records] for k in ("ce", "loss", "grad_norm", "lr")},
        "masks": np.stack([r["masks"] for r in records]),
    }
    variables = dict(params=state.params, batch_stats=state.batch_stats)
    final = (
        interop.export_state_dict(variables),
        interop.export_state_dict(dict(params=state.corruption_params)),
    )
    return case, ours, final


def _bound(case, quantity: str) -> np.ndarray:
    """Per step: ENVELOPE_FACTOR times the running maximum of the envelope (>= FLOOR)."""
    envelope = np.maximum.accumulate(case.outputs[f"envelope_{quantity}"])
    return ENVELOPE_FACTOR * np.maximum(envelope, FLOOR)


@pytest.mark.parametrize("scalar", SCALARS)
def test_every_step_scalar_stays_within_the_rounding_envelope(replay, scalar):
    case, ours, _ = replay
    official = case.outputs[f"official_{scalar}"]
    relative = np.abs(np.asarray(ours[scalar]) - official) / np.maximum(np.abs(official), 1e-30)
    bound = _bound(case, f"{scalar}_rel_diff")
    outside = np.flatnonzero(relative > bound)
    assert outside.size == 0, (
        f"{scalar} leaves {ENVELOPE_FACTOR:g}x the envelope first at step {outside[0] + 1}: "
        f"relative difference {relative[outside[0]]:.3g}, bound {bound[outside[0]]:.3g}"
    )


def test_every_mask_is_the_official_one_while_the_envelope_agrees(replay):
    case, ours, _ = replay
    agrees = case.outputs["envelope_mask_agreement"] == 1.0
    horizon = int(np.argmin(agrees)) if not agrees.all() else len(agrees)
    assert horizon >= 10, "the envelope's masks differ too early for this check to mean much"
    official = case.outputs["official_masks"][:horizon]
    differing = np.flatnonzero(np.any(ours["masks"][:horizon] != official, axis=(1, 2)))
    assert differing.size == 0, (
        f"our masks differ from the official ones at step {differing[0] + 1}"
    )
    # The masks are C's decisions, not a constant: they vary over images and steps.
    assert len({m.tobytes() for m in official.reshape(-1, official.shape[-1])}) > 1


def _relative_distance(ours: dict, official: dict) -> float:
    keys = list(official)
    diff = np.sqrt(sum(np.sum((np.asarray(ours[k], np.float64) - official[k]) ** 2) for k in keys))
    return float(diff / np.sqrt(sum(np.sum(np.float64(official[k]) ** 2) for k in keys)))


def _final(case, prefix: str, keep) -> dict:
    """The recorded final state dict under `prefix`, the entries that `keep(key)` accepts."""
    return {
        k[len(prefix) :]: v.astype(np.float64)
        for k, v in case.outputs.items()
        if k.startswith(prefix) and keep(k)
    }


BUFFERS = ("running_mean", "running_var", "num_batches_tracked")
PARTS = {
    # part: (recorded prefix, which of our two state dicts, its entries, the envelope's name)
    "classifier": ("final_classifier.", 0, lambda k: not k.endswith(BUFFERS), "classifier"),
    "c": ("final_c.", 1, lambda k: True, "c"),
    "bn_mean": ("final_classifier.", 0, lambda k: k.endswith("running_mean"), "bn_mean"),
}


@pytest.mark.parametrize("part", sorted(PARTS))
def test_final_state_stays_within_the_rounding_envelope(replay, part):
    """After the last step: the classifier's parameters, C's, and BatchNorm's running means.
    The running variances are left out: the official one averages the unbiased batch
    variance, ours (flax's) the biased one (docs/method.md)."""
    case, _, final = replay
    prefix, side, keep, envelope = PARTS[part]
    official = _final(case, prefix, keep)
    assert official, f"no recorded {part} entries"
    distance = _relative_distance(final[side], official)
    bound = _bound(case, f"{envelope}_distance")[-1]
    assert distance <= bound, f"{part}: relative distance {distance:.3g} > bound {bound:.3g}"
