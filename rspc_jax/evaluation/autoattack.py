"""AutoAttack (Croce & Hein, ICML 2020) as a cascade of the attacks in `attacks`, `fab` and
`square` (docs/evaluation.md, "Attacks: the AutoAttack cascade").

A point is attacked only while it is still robust: clean errors count as broken, and once
an attack fools a point no later attack needs to. Shapes are static in JAX, so every stage
runs on the whole batch and the robust flags are AND-ed; this equals attacking only the
remaining points, because examples are attacked independently. A stage (or one target
class) with no robust point left is skipped, and Square spends queries only on the points
still robust.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from rspc_jax.evaluation import attacks, fab, square

# The stages of each version, in cascade order.
VERSIONS = {
    "standard": ("apgd_ce", "apgd_t", "fab_t", "square"),
    "rand": ("apgd_ce", "apgd_dlr"),
}
RAND_EOT_ITER = 20  # gradient samples per APGD step in the `rand` version


def stage_keys(rng: jax.Array, version: str) -> dict:
    """The key of each stage of `version` (and of the clean pass, 'clean'), so that a stage
    can be rerun alone; APGD-T splits its key over the target classes."""
    names = ("clean", *VERSIONS[version])
    return dict(zip(names, jax.random.split(rng, len(names))))


class AutoAttackResult(NamedTuple):
    robust: dict  # 'clean', then each stage of the version: (B,) bool, robust after it
    square_queries: jax.Array | None  # (B,) Square's queries per example ('standard' only)


def _attack_the_robust(attack, still_robust: jax.Array) -> jax.Array:
    """still_robust AND attack()'s robust flags; nothing runs once no point is left."""
    return jax.lax.cond(
        jnp.any(still_robust), lambda: still_robust & attack(), lambda: still_robust
    )


def _apgd_stage(logits_fn, x, y, key, still_robust, *, eps, n_iter, loss, **kwargs):
    """One APGD stage on the points still robust: their robust flags after it."""

    def attack():
        _, robust_apgd = attacks.apgd(
            logits_fn, x, y, key, eps=eps, n_iter=n_iter, loss=loss, **kwargs
        )
        return robust_apgd

    return _attack_the_robust(attack, still_robust)


def _targeted_stages(logits_fn, x, y, keys, robust, targets, *, eps, n_iter, n_queries):
    """The standard version after APGD-CE: APGD-T and FAB-T towards every target, then
    Square; adds their robust flags to `robust` and returns Square's queries."""
    stage = functools.partial(_apgd_stage, logits_fn, x, y, eps=eps, n_iter=n_iter)

    def apgd_target(still_robust, target_and_key):
        y_target, key = target_and_key
        return stage(key, still_robust, loss="dlr_targeted", y_target=y_target), None

    target_keys = jax.random.split(keys["apgd_t"], targets.shape[0])
    robust["apgd_t"], _ = jax.lax.scan(apgd_target, robust["apgd_ce"], (targets, target_keys))

    def fab_target(still_robust, y_target):
        def attack():
            _, distance = fab.fab_targeted(logits_fn, x, y, y_target, n_iter=n_iter)
            return distance > eps

        return _attack_the_robust(attack, still_robust), None

    robust["fab_t"], _ = jax.lax.scan(fab_target, robust["apgd_t"], targets)
    _, robust_square, queries = square.square(
        logits_fn, x, y, keys["square"], eps=eps, n_queries=n_queries, attack=robust["fab_t"]
    )
    robust["square"] = robust["fab_t"] & robust_square
    return queries


def autoattack(
    logits_fn,
    x: jax.Array,
    y: jax.Array,
    rng: jax.Array,
    *,
    eps: float,
    version: str = "standard",
    n_iter: int = 100,
    n_target_classes: int = 9,
    n_queries: int = 5000,
) -> AutoAttackResult:
    """AutoAttack's L-inf cascade, one restart per attack.

    'standard': APGD-CE, APGD-T (targeted DLR towards each of the 2nd .. (n_target_classes
    + 1)-th highest clean logits), FAB-T (the same targets; a point counts as broken when
    FAB's smallest adversarial example is within eps) and Square (n_queries queries), with
    logits_fn(pixels). 'rand' (randomised models): APGD-CE and untargeted APGD-DLR with EOT
    over RAND_EOT_ITER draws, with a randomised logits_fn(pixels, key); clean accuracy is one
    draw. APGD and FAB run n_iter iterations.
    """
    if version not in VERSIONS:
        raise ValueError(
            f"unknown AutoAttack version {version!r}; expected one of {list(VERSIONS)}"
        )
    randomised = version == "rand"
    keys = stage_keys(rng, version)
    clean_logits = attacks.at_least_float32(
        logits_fn(x, keys["clean"]) if randomised else logits_fn(x)
    )
    robust = {"clean": ~attacks.misclassified(clean_logits, y)}
    stage = functools.partial(_apgd_stage, logits_fn, x, y, eps=eps, n_iter=n_iter)
    if randomised:
        eot = dict(eot_iter=RAND_EOT_ITER)
        robust["apgd_ce"] = stage(keys["apgd_ce"], robust["clean"], loss="ce", **eot)
        robust["apgd_dlr"] = stage(keys["apgd_dlr"], robust["apgd_ce"], loss="dlr", **eot)
        return AutoAttackResult(robust, None)

    if not 1 <= n_target_classes < clean_logits.shape[-1]:
        raise ValueError(
            f"n_target_classes={n_target_classes} needs 1 .. "
            f"{clean_logits.shape[-1] - 1} other classes"
        )
    targets = attacks.autoattack_targets(clean_logits, n_target_classes)
    robust["apgd_ce"] = stage(keys["apgd_ce"], robust["clean"], loss="ce")
    queries = _targeted_stages(
        logits_fn, x, y, keys, robust, targets, eps=eps, n_iter=n_iter, n_queries=n_queries
    )
    return AutoAttackResult(robust, queries)
