"""The paper's ablations and adversarial-training baselines as switches on any config:

    python -m rspc_jax.main --config=configs/ablations.py:fan_b_hybrid/random_patches ...
    python -m rspc_jax.main --config=configs/ablations.py:demo/fgsm_at --workdir=runs/demo_fgsm

`<base>` is a config file in this folder (its own variant after a colon is not
supported here: use --config.* overrides), `<name>` one of rspc_jax.training.ablations.ABLATIONS
(README "Baselines and ablations"). Sweeps over rho and lambda are flags on top:
--config.rspc.rho=0.2 --config.rspc.lam=0.01.
"""

import importlib.util
import os

from rspc_jax.training import ablations


def get_config(arg=None):
    base, _, name = (arg or "").partition("/")
    if name not in ablations.ABLATIONS:
        raise ValueError(
            f"use configs/ablations.py:<base>/<name> with a name from "
            f"{sorted(ablations.ABLATIONS)} (got {arg!r})"
        )
    path = os.path.join(os.path.dirname(__file__), f"{base}.py")
    if not os.path.isfile(path):
        raise ValueError(f"no base config {path} for configs/ablations.py:{arg}")
    spec = importlib.util.spec_from_file_location(f"configs_{base}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return ablations.apply(module.get_config(), name)
