"""The suites that need only the run's own eval split: clean, corrupted_local,
patch_occlusion, attention_stability, adversarial. Each takes a `runner.Context` and
returns a JSON-serialisable dict (plus arrays for the figures under 'figures', which
the caller strips)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from rspc_jax import ConfigError, rspc
from rspc_jax.data import eval as data
from rspc_jax.evaluation import attacks, autoattack, occlusion, protocols, selection
from rspc_jax.evaluation import loop as runner
from rspc_jax.evaluation.loop import Context, SuiteSkipped, run_pass, sharded

# --------------------------------------------------------------------------------------
# clean


def clean(ctx: Context, fgsm_eps: float = 0.0) -> dict:
    """Top-1/top-5 accuracy and cross-entropy on the eval split; with `fgsm_eps` > 0 also
    the FGSM accuracy (pixels in [0, 1], no random start: the thesis's early-stopping
    metric). Training's periodic evaluation is this suite."""
    mean, std = jnp.asarray(ctx.spec.mean), jnp.asarray(ctx.spec.std)

    def step(variables, batch, rng):
        logits = ctx.logits(variables, batch["image"]).astype(jnp.float32)
        labels = batch["label"]
        out = dict(
            top1=runner.correct(logits, labels),
            top5=runner.correct(logits, labels, min(5, logits.shape[-1])),
            ce=attacks.cross_entropy(logits, labels),
        )
        if fgsm_eps > 0:
            logits_fn = lambda pixels: ctx.logits(variables, (pixels - mean) / std)  # noqa: E731
            adv = attacks.fgsm(logits_fn, batch["image"] * std + mean, labels, eps=fgsm_eps)
            out["fgsm"] = runner.correct(logits_fn(adv), labels)
        return out

    out = run_pass(
        ctx,
        sharded(ctx, step, name=f"clean_fgsm{fgsm_eps}"),
        jax.random.PRNGKey(ctx.seed),
        label="clean",
    )
    result = dict(
        top1=float(out["top1"].mean()),
        top5=float(out["top5"].mean()),
        loss=float(out["ce"].mean()),
        num_examples=int(out["top1"].size),
    )
    if fgsm_eps > 0:
        result["fgsm_accuracy"] = float(out["fgsm"].mean())
    return result


# --------------------------------------------------------------------------------------
# corrupted_local: ImageNet-C-style corruptions generated on the fly


def _corrupter(name: str, severity: int, seed: int):
    """transform(uint8 images, labels) with imagecorruptions' global NumPy RNG seeded once
    per (corruption, severity, host), so a rerun gives the same images."""
    from imagecorruptions import corrupt

    np.random.seed(seed)

    def transform(images, labels):
        return np.stack(
            [corrupt(image, severity=severity, corruption_name=name) for image in images]
        )

    return transform


def corrupted_local(ctx: Context) -> dict:
    if ctx.config.image_size < 32:
        raise SuiteSkipped("imagecorruptions needs images of at least 32x32 pixels")
    names = protocols.corruption_names(ctx.settings.corruptions)
    step = runner.accuracy_step(ctx)
    accuracy = {}
    for c, name in enumerate(names):
        for severity in ctx.settings.severities:
            seed = (ctx.seed * 1000 + c * 10 + severity) * 1000 + jax.process_index()
            out = run_pass(
                ctx,
                step,
                jax.random.PRNGKey(0),
                label=f"{name} s{severity}",
                transform=_corrupter(name, severity, seed),
            )
            accuracy[f"{name}/{severity}"] = float(out["correct"].mean())
    per_corruption = {
        name: float(np.mean([accuracy[f"{name}/{s}"] for s in ctx.settings.severities]))
        for name in names
    }
    no_noise = [v for k, v in per_corruption.items() if k not in protocols.NOISE_CORRUPTIONS]
    return dict(
        note=(
            "corruptions generated on the fly with imagecorruptions-imaug on the "
            f"{ctx.config.dataset} eval images after their eval preprocessing; NOT the "
            "released ImageNet-C/CIFAR-C files, so not comparable with published numbers"
        ),
        accuracy=accuracy,
        per_corruption=per_corruption,
        mean_accuracy=float(np.mean(list(per_corruption.values()))),
        mean_accuracy_no_noise=float(np.mean(no_noise)) if no_noise else None,
        corruptions=list(names),
        severities=list(ctx.settings.severities),
    )


# --------------------------------------------------------------------------------------
# patch_occlusion (Fig. 2 right) and the trained corruption model's masks (Fig. 6)


def _learned_keep(ctx: Context, images):
    """C's masks: by the official rule, or (a C that samples its masks) its deterministic
    choice, the lowest standardised scores, ties broken by fixed draws."""
    corruption_model = rspc.make_corruption_model(ctx.config.rspc, ctx.patch_size)
    scores = corruption_model.apply({"params": ctx.corruption_params}, images)
    if rspc.selection_temperature(ctx.config.rspc) is None:
        return rspc.keep_mask(scores, ctx.settings.occlusion_rho)
    ties = jax.random.gumbel(jax.random.PRNGKey(ctx.seed), scores.shape)
    return rspc.sampled_keep_mask(scores, ctx.settings.occlusion_rho, ties, 0.0)


def patch_occlusion(ctx: Context) -> dict:
    masks, occluded = ctx.settings.occlusion_masks, ctx.occluded_count()
    learned = ctx.corruption_params is not None and ctx.settings.occlusion_rho > 0
    every = None
    if 0 < math.comb(ctx.num_patches(), occluded) <= ctx.settings.occlusion_every_mask_limit:
        every = jnp.asarray(occlusion.every_keep_mask(ctx.num_patches(), occluded))

    def every_mask(variables, batch, rng, keep):
        """Correct under one mask, the same for every image (same noise for every mask)."""
        images = batch["image"]
        keep = jnp.broadcast_to(keep, (images.shape[0], keep.shape[0]))
        logits = ctx.logits(variables, ctx.occlude(images, keep, rng))
        return runner.correct(logits, batch["label"])

    def step(variables, batch, rng):
        images, labels = batch["image"], batch["label"]

        def one_mask(key):
            mask_key, noise_key = jax.random.split(key)
            keep = occlusion.random_keep_masks(
                mask_key, images.shape[0], ctx.num_patches(), occluded
            )
            return runner.correct(
                ctx.logits(variables, ctx.occlude(images, keep, noise_key)), labels
            )

        out = dict(
            clean=runner.correct(ctx.logits(variables, images), labels),
            random=jax.lax.map(one_mask, jax.random.split(rng, masks)).T,
        )
        if every is not None:
            out["every"] = jax.lax.map(
                functools.partial(every_mask, variables, batch, rng), every
            ).T
        if learned:
            keep = _learned_keep(ctx, images)
            out["learned"] = runner.correct(
                ctx.logits(variables, ctx.occlude(images, keep, rng)), labels
            )
            out["learned_occluded"] = (keep == 0).astype(jnp.int8)
            if ctx.spec.object_threshold is not None:
                pixels = images * jnp.asarray(ctx.spec.std) + jnp.asarray(ctx.spec.mean)
                out["on_object"] = selection.object_patches(
                    pixels, ctx.patch_size, ctx.spec.object_threshold
                ).astype(jnp.int8)
        return out

    out = run_pass(
        ctx, sharded(ctx, step), jax.random.PRNGKey(ctx.seed + 1), label="patch_occlusion"
    )
    per_mask = out["random"].mean(axis=0)
    result = dict(
        rho=ctx.settings.occlusion_rho,
        occluded_patches=occluded,
        num_patches=ctx.num_patches(),
        masks_per_image=masks,
        clean_accuracy=float(out["clean"].mean()),
        random_mask_accuracy=_distribution(per_mask),
        per_mask_accuracy=[float(a) for a in per_mask],
        num_examples=int(out["clean"].size),
    )
    if every is not None:
        result["every_mask_accuracy"] = dict(
            masks=int(every.shape[0]),
            mean=float(out["every"].mean()),
            worst_case=float(out["every"].min(axis=1).mean()),
        )
    if learned:
        result["learned_mask_accuracy"] = float(out["learned"].mean())
        result["selection"] = _selection_statistics(out["learned_occluded"], out.get("on_object"))
        if ctx.spec.background is not None:
            result["selection"]["blank_mask_iou"] = _blank_mask_iou(ctx, out["learned_occluded"])
        result["figures"] = dict(learned_masks=_learned_mask_examples(ctx))
    return result


def _selection_statistics(occluded: np.ndarray, on_object=None, pairs_of: int = 1024) -> dict:
    """evaluation/selection.py's numbers over the eval set: distinct masks counted exactly,
    the mask IoU over the first `pairs_of` images (it compares every pair)."""
    _, counts = np.unique(occluded, axis=0, return_counts=True)
    stats = dict(
        distinct_masks=int(len(counts)),
        modal_mask_share=float(counts.max()) / len(occluded),
        entropy=float(selection.selection_entropy(jnp.asarray(occluded))),
        mask_iou=float(selection.mask_iou(jnp.asarray(occluded[:pairs_of]))),
        mask_iou_images=int(min(len(occluded), pairs_of)),
        position_frequency=[float(f) for f in occluded.mean(axis=0)],
    )
    if on_object is not None:
        stats["on_object"] = float((occluded * on_object).sum() / max(occluded.sum(), 1))
    return stats


def _blank_mask_iou(ctx: Context, occluded: np.ndarray) -> float:
    """Mean IoU of each image's mask with C's mask of an image of pure background: 1 when C's
    choice comes from the background alone (the same for every image), not from the object."""
    size = ctx.config.image_size
    background = (ctx.spec.background - np.asarray(ctx.spec.mean)) / np.asarray(ctx.spec.std)
    blank = jnp.broadcast_to(jnp.asarray(background, jnp.float32), (1, size, size, 3))
    blank_occluded = np.asarray(_learned_keep(ctx, blank)[0] == 0)
    intersection = (occluded.astype(bool) & blank_occluded).sum(axis=1)
    union = (occluded.astype(bool) | blank_occluded).sum(axis=1)
    return float(np.mean(intersection / np.maximum(union, 1)))


def _distribution(values: np.ndarray) -> dict:
    q1, median, q3 = np.percentile(values, [25, 50, 75])
    return dict(
        mean=float(values.mean()),
        std=float(values.std()),
        min=float(values.min()),
        q1=float(q1),
        median=float(median),
        q3=float(q3),
        max=float(values.max()),
    )


def _first_batch(ctx: Context, count: int):
    """The first `count` eval images (normalised, this host) for the figures."""
    examples, _ = ctx.examples()
    size = ctx.config.image_size
    batch = next(
        data.host_batches(
            examples,
            local_batch=count,
            batches=1,
            image_shape=(size, size, 3),
            mean=ctx.spec.mean,
            std=ctx.spec.std,
        )
    )
    return batch["image"][batch["mask"] > 0], batch["label"][batch["mask"] > 0]


def _to_pixels(ctx: Context, images):
    return np.clip(np.asarray(images) * np.asarray(ctx.spec.std) + np.asarray(ctx.spec.mean), 0, 1)


def _learned_mask_examples(ctx: Context) -> dict:
    images, _ = _first_batch(ctx, ctx.settings.figure_images)
    keep = jax.jit(functools.partial(_learned_keep, ctx))(images)
    return dict(
        images=_to_pixels(ctx, images),
        keep=np.asarray(keep),
        grid=ctx.config.image_size // ctx.patch_size,
    )


# --------------------------------------------------------------------------------------
# attention_stability (Figs. 2 left, 4, 5)


def attention_stability(ctx: Context) -> dict:
    occluded = ctx.occluded_count()

    def step(variables, batch, rng):
        images = batch["image"]
        mask_key, noise_key = jax.random.split(rng)
        keep = occlusion.random_keep_masks(mask_key, images.shape[0], ctx.num_patches(), occluded)
        _, clean_maps = ctx.logits_and_attention(variables, images)
        _, occluded_maps = ctx.logits_and_attention(variables, ctx.occlude(images, keep, noise_key))
        return dict(cos=occlusion.attention_cosine(clean_maps, occluded_maps))

    out = run_pass(
        ctx, sharded(ctx, step), jax.random.PRNGKey(ctx.seed + 2), label="attention_stability"
    )
    per_image = out["cos"].mean(axis=1)
    kind = attention_kind(ctx.model)
    result = dict(
        maps={
            "channels": "XCiT channel attention (d x d per head)",
            "windows": "Swin window attention (one w^2 x w^2 map per window and head)",
            "tokens": "token attention (N x N per head)",
        }[kind],
        definition=(
            "per image: mean over layers and heads of cos(vec(A_clean), vec(A_occluded)), "
            "one random mask per image"
        ),
        occluded_patches=occluded,
        mean_cos_sim=float(per_image.mean()),
        per_image=_distribution(per_image),
        per_image_values=[round(float(v), 5) for v in per_image],
        per_layer=[float(v) for v in out["cos"].mean(axis=0)],
        num_examples=int(per_image.size),
        figures=dict(histogram=per_image),
    )
    if kind == "tokens":  # a query patch's map over the whole grid
        result["figures"]["query_maps"] = _query_maps(ctx)
    return result


def attention_kind(model) -> str:
    """What the sown attention maps attend over: 'tokens' (N x N, what the query-patch figures
    and Patch-Fool need), 'channels' (XCiT's d x d maps) or 'windows' (Swin's maps inside each
    local window)."""
    return {"XCiT": "channels", "Swin": "windows"}.get(type(model).__name__, "tokens")


def _query_maps(ctx: Context) -> dict:
    """Head-mean attention of the centre patch per layer, clean vs one occlusion, for the
    first figure images (Figs. 2 left, 4)."""
    images, _ = _first_batch(ctx, ctx.settings.figure_images)

    @jax.jit
    def maps(variables, images, rng):
        mask_key, noise_key = jax.random.split(rng)
        keep = occlusion.random_keep_masks(
            mask_key, images.shape[0], ctx.num_patches(), ctx.occluded_count()
        )
        corrupted = ctx.occlude(images, keep, noise_key)
        _, clean_maps = ctx.logits_and_attention(variables, images)
        _, occluded_maps = ctx.logits_and_attention(variables, corrupted)
        return (
            corrupted,
            [occlusion.query_attention(m) for m in clean_maps],
            [occlusion.query_attention(m) for m in occluded_maps],
        )

    corrupted, clean_maps, occluded_maps = maps(
        ctx.variables, images, jax.random.PRNGKey(ctx.seed + 3)
    )
    return dict(
        images=_to_pixels(ctx, images),
        occluded=_to_pixels(ctx, corrupted),
        clean=[np.asarray(m) for m in clean_maps],
        occluded_maps=[np.asarray(m) for m in occluded_maps],
    )


# --------------------------------------------------------------------------------------
# adversarial: FGSM, PGD, APGD-CE, the AutoAttack cascade, Patch-Fool (pixel space [0,1])


ATTACKS = ("fgsm", "pgd", "apgd_ce", "autoattack", "patch_fool")


def adversarial(ctx: Context) -> dict:
    s = ctx.settings
    attacks_run = [a for a in s.attacks.split(",") if a]
    unknown = sorted(set(attacks_run) - set(ATTACKS))
    if unknown:
        raise ConfigError(f"config.evaluation.attacks: unknown {unknown}; choose from {ATTACKS}")
    if s.autoattack_version not in autoattack.VERSIONS:
        raise ConfigError(
            f"config.evaluation.autoattack_version={s.autoattack_version!r}; "
            f"choose from {list(autoattack.VERSIONS)}"
        )
    stages = autoattack.VERSIONS[s.autoattack_version]
    randomised = s.autoattack_version == "rand"
    mean, std = jnp.asarray(ctx.spec.mean), jnp.asarray(ctx.spec.std)
    token_attention = attention_kind(ctx.model) == "tokens"
    if token_attention:  # Patch-Fool's block 4 of a 12-block DeiT; capped for shallow models
        image = jax.ShapeDtypeStruct(
            (1, ctx.config.image_size, ctx.config.image_size, 3), jnp.float32
        )
        layers = len(jax.eval_shape(ctx.logits_and_attention, ctx.variables, image)[1])
        fool_block = min(s.patch_fool_block, layers - 1)

    def step(variables, batch, rng):
        x = batch["image"] * std + mean
        y = batch["label"]
        logits_fn = lambda pixels: ctx.logits(variables, (pixels - mean) / std)  # noqa: E731
        keys = jax.random.split(rng, 4)
        out = dict(clean=runner.correct(logits_fn(x), y))
        if "fgsm" in attacks_run:
            out["fgsm"] = runner.correct(
                logits_fn(attacks.fgsm(logits_fn, x, y, eps=s.fgsm_eps)), y
            )
        if "pgd" in attacks_run:
            x_pgd = attacks.pgd(
                logits_fn, x, y, keys[0], eps=s.pgd_eps, step_size=s.pgd_step, steps=s.pgd_steps
            )
            out["pgd"] = runner.correct(logits_fn(x_pgd), y)
            out["pgd_linf"] = jnp.abs(x_pgd - x).max(axis=(1, 2, 3))
        if "autoattack" in attacks_run:
            cascade = autoattack.autoattack(
                # The models are deterministic in eval mode: 'rand' draws the same logits.
                (lambda pixels, key: logits_fn(pixels)) if randomised else logits_fn,
                x,
                y,
                keys[1],
                eps=s.apgd_eps,
                version=s.autoattack_version,
                n_iter=s.apgd_iters,
                n_target_classes=s.apgd_targets,
                n_queries=s.square_queries,
            )
            out.update({f"autoattack/{k}": v for k, v in cascade.robust.items()})
            out["autoattack"] = cascade.robust[stages[-1]]
            if cascade.square_queries is not None:
                out["autoattack/square_queries"] = cascade.square_queries
        if "apgd_ce" in attacks_run:
            if "autoattack" in attacks_run and not randomised:  # the cascade's first stage
                out["apgd_ce"] = out["autoattack/apgd_ce"]
            else:
                _, out["apgd_ce"] = attacks.apgd(
                    logits_fn, x, y, keys[1], eps=s.apgd_eps, n_iter=s.apgd_iters
                )
        if "patch_fool" in attacks_run and s.patch_fool_steps and token_attention:
            attention_fn = lambda pixels: ctx.logits_and_attention(  # noqa: E731
                variables, (pixels - mean) / std
            )
            x_fool = attacks.patch_fool(
                attention_fn,
                x,
                y,
                keys[3],
                patch_size=ctx.model.patch_size,
                std=ctx.spec.std,
                num_patches=s.patch_fool_patches,
                attention_block=fool_block,
                steps=s.patch_fool_steps,
            )
            out["patch_fool"] = runner.correct(logits_fn(x_fool), y)
        return out

    out = run_pass(
        ctx,
        sharded(ctx, step),
        jax.random.PRNGKey(ctx.seed + 4),
        label="adversarial",
        limit=s.adversarial_examples,
    )
    accuracy = {k: float(out[k].mean()) for k in ("clean", *ATTACKS) if k in out}
    return dict(
        accuracy=accuracy,
        num_examples=int(out["clean"].size),
        max_pgd_linf=float(out["pgd_linf"].max()) if "pgd_linf" in out else None,
        autoattack=_cascade_counts(out, stages) if "autoattack" in attacks_run else None,
        settings=dict(
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
            eot_iter=autoattack.RAND_EOT_ITER if randomised else None,
            patch_fool=dict(
                patches=s.patch_fool_patches,
                block=fool_block if token_attention else None,
                steps=s.patch_fool_steps,
                mode="attention",
            ),
        ),
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


SUITES = {
    "clean": clean,
    "corrupted_local": corrupted_local,
    "patch_occlusion": patch_occlusion,
    "attention_stability": attention_stability,
    "adversarial": adversarial,
}
