"""corrupted_local: ImageNet-C-style corruptions generated on the fly (imagecorruptions) on
the run's own eval images; not the released files, so not comparable with published
numbers."""

from collections import OrderedDict
import hashlib
import inspect

import jax
import numpy as np

from rspc_jax.evaluation import figures as plots
from rspc_jax.evaluation import loop as runner
from rspc_jax.evaluation import protocols, report
from rspc_jax.evaluation.loop import Context, SuiteSkipped, run_pass

# Corrupted batches by (corruption, severity, NumPy's global RNG state, input images), newest
# last, within _MEMO_BYTES. A study evaluates every method of a seed on the same images with the
# same seeds, so all runs but the first of a seed reuse them instead of recomputing them (most
# of this suite's time at small image sizes). A hit restores the RNG state a computation would
# have left, so hit or miss the images are bit for bit the same.
_MEMO: "OrderedDict[bytes, tuple]" = OrderedDict()
_MEMO_BYTES = 256 << 20


def _key(name: str, severity: int, images: np.ndarray) -> bytes:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    digest = hashlib.blake2b(f"{name}/{severity}/{kind}/{pos}/{has_gauss}/{gauss!r}".encode())
    digest.update(keys.tobytes())
    digest.update(f"{images.shape}/{images.dtype}".encode())
    digest.update(np.ascontiguousarray(images).tobytes())
    return digest.digest()


def _remember(key: bytes, out: np.ndarray, state: tuple) -> None:
    _MEMO[key] = (out, state)
    while len(_MEMO) > 1 and sum(o.nbytes for o, _ in _MEMO.values()) > _MEMO_BYTES:
        _MEMO.popitem(last=False)


def _corrupt(image: np.ndarray, name: str, severity: int) -> np.ndarray:
    """imagecorruptions' corruption of one image. Its impulse_noise and glass_blur draw their
    own seed from fresh entropy unless given one, so `np.random.seed` alone leaves them
    unrepeatable; they get one drawn from the seeded global RNG."""
    import imagecorruptions

    kwargs = {}
    if "seed" in inspect.signature(imagecorruptions.corruption_dict[name]).parameters:
        kwargs["seed"] = int(np.random.randint(2**31 - 1))
    return imagecorruptions.corrupt(image, severity=severity, corruption_name=name, **kwargs)


def _corrupter(name: str, severity: int, seed: int):
    """transform(uint8 images, labels) with imagecorruptions' global NumPy RNG seeded once
    per (corruption, severity, host), so a rerun gives the same images (from `_MEMO` when
    this process made them before)."""
    np.random.seed(seed)

    def transform(images, labels):
        key = _key(name, severity, images)
        if key not in _MEMO:
            out = np.stack([_corrupt(image, name, severity) for image in images])
            _remember(key, out, np.random.get_state())
        out, state = _MEMO[key]
        np.random.set_state(state)
        return out.copy()

    return transform


def run(ctx: Context) -> dict:
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


def rows(result: dict) -> list[tuple[str, str]]:
    per_corruption = [
        (f"{c} (%, mean over severities)", report.pct(a))
        for c, a in result["per_corruption"].items()
    ]
    return per_corruption + [
        ("mean accuracy (%)", report.pct(result["mean_accuracy"])),
        ("mean accuracy w/o noise (%)", report.pct(result["mean_accuracy_no_noise"])),
    ]


def figures(result: dict, arrays: dict, out_dir: str) -> list[str]:
    return [plots.corruption_errors(result, out_dir, "corrupted_local")]
