"""The schedule on C's objective (`rspc.corruption_warmup_epochs`,
`corruption_curriculum_epochs`; docs/method.md, "A schedule on C's objective"): C frozen
during the warm-up, then helping (descending the loss) before it turns adversarial; off by
default, where C's optimizer is the official chain, state and all."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from rspc_jax import rspc
from rspc_jax.training import checks, defaults

OPT = ml_collections.ConfigDict(
    dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.05, clip_norm=5.0)
)


def _updates(tx, grads, steps):
    """C's parameter after each of `steps` updates with the same gradient."""
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    out = []
    for _ in range(steps):
        updates, state = tx.update({"w": grads}, state, params)
        params = optax.apply_updates(params, updates)
        out.append(np.asarray(params["w"]))
    return np.stack(out)


def test_the_direction_freezes_then_turns_from_helping_to_ascent():
    factor = rspc.corruption_direction(warmup_steps=4, curriculum_steps=8)
    got = [float(factor(count)) for count in range(16)]
    np.testing.assert_allclose(
        got, [0, 0, 0, 0, -1, -0.75, -0.5, -0.25, 0, 0.25, 0.5, 0.75, 1, 1, 1, 1]
    )
    np.testing.assert_allclose(
        [float(rspc.corruption_direction(3, 0)(c)) for c in range(5)], [0, 0, 0, 1, 1]
    )


def test_default_optimizer_is_the_official_chain():
    """Without a schedule nothing is added: the same state tree and the same updates."""
    official = optax.chain(
        optax.clip_by_global_norm(5.0),
        rspc.negate_finite(),
        optax.add_decayed_weights(0.05),
        optax.sgd(1e-2, momentum=0.9, nesterov=True),
    )
    tx = rspc.corruption_optimizer(OPT)
    params = {"w": jnp.ones(3)}
    assert jax.tree.structure(tx.init(params)) == jax.tree.structure(official.init(params))
    grads = jnp.asarray([0.3, -2.0, 7.0])
    np.testing.assert_array_equal(_updates(tx, grads, 5), _updates(official, grads, 5))


def test_warmup_keeps_c_still_then_it_ascends_as_the_official_one_from_there():
    grads = jnp.asarray([0.3, -2.0, 1.0])
    warm = _updates(rspc.corruption_optimizer(OPT, warmup_steps=3), grads, 8)
    # Only weight decay moves C during the warm-up (lr * wd = 5e-4 of it per step, more with
    # momentum), the same for every coordinate whatever its gradient.
    assert np.abs(warm[2] - 1).max() < 1e-2
    np.testing.assert_allclose(warm[2], warm[2][0], rtol=1e-6)
    # After it C ascends: it moves with the gradient, as the official C does.
    step = warm[7] - warm[3]
    assert (np.sign(step) == np.sign(np.asarray(grads))).all()


def test_curriculum_descends_first_and_ascends_at_the_end():
    grads = jnp.asarray([0.5, -1.0, 0.25])
    tx = rspc.corruption_optimizer(
        ml_collections.ConfigDict(dict(OPT.to_dict(), momentum=0.0, weight_decay=0.0)),
        curriculum_steps=10,
    )
    params = _updates(tx, grads, 11)
    moves = np.diff(np.concatenate([np.ones((1, 3)), params]), axis=0)
    # factor -1, -0.8, ..., 0 at update 5, ..., +1: plain SGD moves lr * factor * (-(-g)).
    factors = np.clip(2 * np.arange(11) / 10 - 1, -1, 1)
    np.testing.assert_allclose(moves, 1e-2 * factors[:, None] * np.asarray(grads), atol=1e-7)


@pytest.mark.parametrize("field", ["corruption_warmup_epochs", "corruption_curriculum_epochs"])
def test_a_negative_schedule_is_refused_before_anything_compiles(field):
    config = defaults.get_default_config()
    config.rspc[field] = -1.0
    with pytest.raises(checks.ConfigError, match=f"rspc.{field}"):
        checks.validate_config(config)
