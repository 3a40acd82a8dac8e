"""adversarial: FGSM, PGD, APGD-CE, the AutoAttack cascade and Patch-Fool, all in pixel
space [0, 1] with the normalisation inside the model function."""

import jax
import jax.numpy as jnp

from rspc_jax import ConfigError
from rspc_jax.evaluation import attacks, autoattack, report
from rspc_jax.evaluation import figures as plots
from rspc_jax.evaluation import loop as runner
from rspc_jax.evaluation.loop import Context, run_pass, sharded
from rspc_jax.evaluation.suites import shared

ATTACKS = ("fgsm", "pgd", "apgd_ce", "autoattack", "patch_fool")


def _requested_attacks(settings) -> list[str]:
    """config.evaluation.attacks, checked, with the AutoAttack version."""
    requested = [a for a in settings.attacks.split(",") if a]
    unknown = sorted(set(requested) - set(ATTACKS))
    if unknown:
        raise ConfigError(f"config.evaluation.attacks: unknown {unknown}; choose from {ATTACKS}")
    if settings.autoattack_version not in autoattack.VERSIONS:
        raise ConfigError(
            f"config.evaluation.autoattack_version={settings.autoattack_version!r}; "
            f"choose from {list(autoattack.VERSIONS)}"
        )
    return requested


def _fool_block(ctx: Context):
    """Patch-Fool's attention block (block 4 of a 12-block DeiT, capped for shallow models),
    or None where the model's maps are not token attention."""
    if shared.attention_kind(ctx.model) != "tokens":
        return None
    return min(ctx.settings.patch_fool_block, shared.attention_layers(ctx) - 1)


def _autoattack_outputs(settings, logits_fn, x, y, rng) -> dict:
    """Robust flags after every stage of the cascade (and Square's queries)."""
    randomised = settings.autoattack_version == "rand"
    cascade = autoattack.autoattack(
        # The models are deterministic in eval mode: 'rand' draws the same logits.
        (lambda pixels, key: logits_fn(pixels)) if randomised else logits_fn,
        x,
        y,
        rng,
        eps=settings.apgd_eps,
        version=settings.autoattack_version,
        n_iter=settings.apgd_iters,
        n_target_classes=settings.apgd_targets,
        n_queries=settings.square_queries,
    )
    out = {f"autoattack/{k}": v for k, v in cascade.robust.items()}
    out["autoattack"] = cascade.robust[autoattack.VERSIONS[settings.autoattack_version][-1]]
    if cascade.square_queries is not None:
        out["autoattack/square_queries"] = cascade.square_queries
    return out


def _patch_fool_correct(ctx: Context, variables, logits_fn, x, y, rng, block: int):
    s, mean, std = ctx.settings, jnp.asarray(ctx.spec.mean), jnp.asarray(ctx.spec.std)
    x_fool = attacks.patch_fool(
        lambda pixels: ctx.logits_and_attention(variables, (pixels - mean) / std),
        x,
        y,
        rng,
        patch_size=ctx.model.patch_size,
        std=ctx.spec.std,
        num_patches=s.patch_fool_patches,
        attention_block=block,
        steps=s.patch_fool_steps,
    )
    return runner.correct(logits_fn(x_fool), y)


def _step(ctx: Context, requested: list[str], fool_block):
    """The per-device step: correct (B,) on clean inputs and under every requested attack."""
    s = ctx.settings
    mean, std = jnp.asarray(ctx.spec.mean), jnp.asarray(ctx.spec.std)
    reuse_cascade = "autoattack" in requested and s.autoattack_version != "rand"

    def step(variables, batch, rng):
        x, y = batch["image"] * std + mean, batch["label"]
        logits_fn = lambda pixels: ctx.logits(variables, (pixels - mean) / std)  # noqa: E731
        keys = jax.random.split(rng, 4)
        out = dict(clean=runner.correct(logits_fn(x), y))
        if "fgsm" in requested:
            x_fgsm = attacks.fgsm(logits_fn, x, y, eps=s.fgsm_eps)
            out["fgsm"] = runner.correct(logits_fn(x_fgsm), y)
        if "pgd" in requested:
            x_pgd = attacks.pgd(
                logits_fn, x, y, keys[0], eps=s.pgd_eps, step_size=s.pgd_step, steps=s.pgd_steps
            )
            out["pgd"] = runner.correct(logits_fn(x_pgd), y)
            out["pgd_linf"] = jnp.abs(x_pgd - x).max(axis=(1, 2, 3))
        if "autoattack" in requested:
            out.update(_autoattack_outputs(s, logits_fn, x, y, keys[1]))
        if "apgd_ce" in requested:
            if reuse_cascade:  # the cascade's first stage
                out["apgd_ce"] = out["autoattack/apgd_ce"]
            else:
                _, out["apgd_ce"] = attacks.apgd(
                    logits_fn, x, y, keys[1], eps=s.apgd_eps, n_iter=s.apgd_iters
                )
        if "patch_fool" in requested and s.patch_fool_steps and fool_block is not None:
            out["patch_fool"] = _patch_fool_correct(
                ctx, variables, logits_fn, x, y, keys[3], fool_block
            )
        return out

    return step


def _settings_record(s, fool_block) -> dict:
    """The attack settings as the result records them."""
    return dict(
        space="pixels in [0,1], normalisation inside the model",
        fgsm_eps=s.fgsm_eps,
        pgd_eps=s.pgd_eps,
        pgd_step=s.pgd_step,
        pgd_steps=s.pgd_steps,
        apgd_eps=s.apgd_eps,
        apgd_iters=s.apgd_iters,
        apgd_restarts=1,
        autoattack_version=s.autoattack_version,
        autoattack_targets=s.apgd_targets,
        fab_iters=s.apgd_iters,
        square_queries=s.square_queries,
        eot_iter=autoattack.RAND_EOT_ITER if s.autoattack_version == "rand" else None,
        patch_fool=dict(
            patches=s.patch_fool_patches,
            block=fool_block,
            steps=s.patch_fool_steps,
            mode="attention",
        ),
    )


def run(ctx: Context) -> dict:
    s = ctx.settings
    requested = _requested_attacks(s)
    fool_block = _fool_block(ctx)
    out = run_pass(
        ctx,
        sharded(ctx, _step(ctx, requested, fool_block)),
        jax.random.PRNGKey(ctx.seed + 4),
        label="adversarial",
        limit=s.adversarial_examples,
    )
    stages = autoattack.VERSIONS[s.autoattack_version]
    return dict(
        accuracy={k: float(out[k].mean()) for k in ("clean", *ATTACKS) if k in out},
        num_examples=int(out["clean"].size),
        max_pgd_linf=float(out["pgd_linf"].max()) if "pgd_linf" in out else None,
        autoattack=_cascade_counts(out, stages) if "autoattack" in requested else None,
        settings=_settings_record(s, fool_block),
    )


def _cascade_counts(out: dict, stages: tuple) -> dict:
    """Per stage of the AutoAttack cascade: the points it ran on (still robust before it),
    the points it broke and the robust accuracy after it."""
    counts, before = [], out["autoattack/clean"]
    for stage in stages:
        after = out[f"autoattack/{stage}"]
        counts.append(
            dict(
                attack=stage,
                attacked=int(before.sum()),
                broken=int((before & ~after).sum()),
                robust_accuracy=float(after.mean()),
            )
        )
        before = after
    result = dict(stages=counts, robust_accuracy=float(before.mean()))
    if "autoattack/square_queries" in out:
        attacked = out["autoattack/fab_t"]
        queries = out["autoattack/square_queries"][attacked]
        result["square_mean_queries"] = float(queries.mean()) if queries.size else None
    return result


def _autoattack_rows(result: dict) -> list[tuple[str, str]]:
    """One row per stage of the AutoAttack cascade: robust accuracy after it, and on how
    many points it ran and how many it broke."""
    if not result.get("autoattack"):
        return []
    s = result["settings"]
    eot = f", EOT {s['eot_iter']}" if s["eot_iter"] else ""
    names = {
        "apgd_ce": f"APGD-CE{eot}",
        "apgd_t": f"APGD-T ({s['autoattack_targets']} targets)",
        "fab_t": f"FAB-T ({s['autoattack_targets']} targets)",
        "square": f"Square ({s['square_queries']} queries)",
        "apgd_dlr": f"APGD-DLR{eot}",
    }
    return [
        (
            f"AutoAttack after {names[stage['attack']]} (%)",
            f"{report.pct(stage['robust_accuracy'])} (ran on {stage['attacked']}, "
            f"broke {stage['broken']})",
        )
        for stage in result["autoattack"]["stages"]
    ]


def rows(result: dict) -> list[tuple[str, str]]:
    s, accuracy, over255 = result["settings"], result["accuracy"], report.over255
    fool = s["patch_fool"]
    labels = {
        "clean": "clean",
        "fgsm": f"FGSM, eps {over255(s['fgsm_eps'])}",
        "pgd": f"PGD-{s['pgd_steps']}, eps {over255(s['pgd_eps'])}, step {over255(s['pgd_step'])}",
        "apgd_ce": f"APGD-CE, eps {over255(s['apgd_eps'])}, {s['apgd_iters']} iterations",
        "autoattack": f"AutoAttack {s['autoattack_version']}, eps {over255(s['apgd_eps'])}",
        "patch_fool": f"Patch-Fool, {fool['patches']} patch, block {fool['block']}, "
        f"{fool['steps']} Adam steps",
    }
    attacked = [
        (f"{label} (%)", report.pct(accuracy[key]))
        for key, label in labels.items()
        if key in accuracy
    ]
    return attacked + _autoattack_rows(result) + [("examples", str(result["num_examples"]))]


def notes(result: dict) -> list[str]:
    return [f"Attacks in {result['settings']['space']}."]


def figures(result: dict, arrays: dict, out_dir: str) -> list[str]:
    accuracy = result["accuracy"]
    fig, ax = plots.plt.subplots(figsize=(4.5, 3.2))
    ax.bar(list(accuracy), [100 * v for v in accuracy.values()], color="tab:green")
    ax.set_ylabel("top-1 accuracy (%)")
    ax.tick_params(axis="x", rotation=30)
    ax.set_title(f"attacks on {result['num_examples']} images", fontsize=9)
    return [plots.save(fig, out_dir, "adversarial.png")]
