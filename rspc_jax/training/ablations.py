"""The paper's ablations (Table 3, supplementary) and the adversarial-training
baselines (Fig. 7) as named switches on any config: each is a variant of every config
(`configs/<base>.py:<name>`, read by `rspc_jax.training.recipes.select_variant`);
`--variants` of `rspc_jax.plan` and `benchmarks.train_step` use them too."""


def _rspc(**switches):
    def apply(c):
        for key, value in switches.items():
            c.rspc[key] = value

    return apply


def _adversarial(method, eps, steps=1, **extra):
    def apply(c):
        c.rspc.enabled = False
        c.adversarial.update(dict(method=method, eps=eps, steps=steps, **extra))

    return apply


# name -> (what it reproduces, how it changes the config)
ABLATIONS = {
    "clean": ("Table 3 'clean training': the baseline without RSPC", _rspc(enabled=False)),
    "clean_and_corrupted": (
        "Table 3 'clean + corrupted data': CE on clean and on randomly "
        "occluded images, no alignment",
        _rspc(selection="random", objective="ce", lam=1.0),
    ),
    "random_patches": (
        "Table 3 'RSPC on randomly selected patches': alignment, random masks",
        _rspc(selection="random"),
    ),
    "random_object_patches": (
        "beyond the paper: alignment, random masks on the object's patches first (datasets "
        "that say where the object is): the control for a C that selects the object "
        "(docs/method.md, 'Random patches on the object')",
        _rspc(selection="random_object"),
    ),
    "attended_patches": (
        "beyond the paper: alignment, the k patches the classifier attends to most (its clean "
        "attention; no corruption model) (docs/method.md, 'Occluding what the classifier "
        "attends to')",
        _rspc(selection="attended"),
    ),
    "random_attended_patches": (
        "beyond the paper: alignment, k patches at random among the m the classifier attends "
        "to most (rspc.attended_pool; no corruption model)",
        _rspc(selection="random_attended"),
    ),
    "ce_objective": (
        "the corruption model ascends CE on the occluded images instead of "
        "L_align (the classifier descends CE(clean) + CE(occluded))",
        _rspc(objective="ce", lam=1.0),
    ),
    "per_image_c": (
        "beyond the paper: C scores each patch from its own pixels (no position term) and "
        "samples its masks by Gumbel top-k at temperature 1 (docs/method.md, 'A per-image C')",
        _rspc(corruption_model="content", temperature=1.0),
    ),
    "zero_fill": (
        "occluded patches set to 0 in the model input instead of uniform noise",
        _rspc(fill="zero"),
    ),
    "drop_tokens": (
        "selected patches dropped from the token sequence instead of occluded "
        "with noise; alignment over the kept tokens (ViT/DeiT only)",
        _rspc(fill="drop"),
    ),
    "fgsm_at": (
        "FGSM adversarial training, eps 4/255, random start (thesis 4.1)",
        _adversarial("fgsm", 4 / 255),
    ),
    "pgd_at": ("PGD-10 adversarial training, eps 4/255", _adversarial("pgd", 4 / 255, 10)),
    "trades1": ("TRADES K=1, eps 1/255 (paper Fig. 7)", _adversarial("trades", 1 / 255, 1)),
    "trades2": ("TRADES K=2, eps 1/255 (paper Fig. 7)", _adversarial("trades", 1 / 255, 2)),
    "trades3": ("TRADES K=3, eps 1/255 (paper Fig. 7)", _adversarial("trades", 1 / 255, 3)),
}


def apply(config, name: str):
    """Switches `config` (in place) to ablation `name`; returns it."""
    if name not in ABLATIONS:
        raise ValueError(f"unknown ablation {name!r}; choose from {sorted(ABLATIONS)}")
    ABLATIONS[name][1](config)
    return config
