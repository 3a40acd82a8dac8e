"""Export a training run's weights for PyTorch (timm, the official RVT/FAN/RSPC code).

    python -m rspc_jax.export --workdir=DIR --out=rvt_ti_rspc.pth.tar
    python -m rspc_jax.export --workdir=DIR --ema --out=deit_s.safetensors

* RVT and FAN: the container the official test scripts load with timm's
  `load_checkpoint` (strict): {'state_dict', 'state_dict_ema' (when the run kept an EMA),
  'arch'}, written with `torch.save`.
* ViT/DeiT, XCiT and the rest: a bare state dict for
  `timm.create_model(arch).load_state_dict(sd, strict=True)`; `--ema` picks the EMA weights.
* `--format=safetensors` (or an `.safetensors` --out): one set of weights (raw, or EMA with
  `--ema`), arch and step in the metadata; needs no torch.
* `--corruption_out=FILE`: RSPC's corruption model under the official keys
  (`patch_embed.weight`, `fc.weight`), as the official `occlusion/*.pth.tar` holds them.
"""

import json
import os

from absl import app
from absl import flags
from absl import logging
import ml_collections

_WORKDIR = flags.DEFINE_string("workdir", None, "Training run to export (its config.json and "
                               "checkpoints/).", required=True)
_OUT = flags.DEFINE_string("out", None, "Output file.", required=True)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step; default: the latest.")
_EMA = flags.DEFINE_bool("ema", False, "Export the EMA weights (needs a run with ema_decay > 0).")
_FORMAT = flags.DEFINE_enum("format", "auto", ["auto", "torch", "safetensors"],
                            "'auto' = safetensors for a .safetensors --out, else torch.save.")
_CORRUPTION_OUT = flags.DEFINE_string(
    "corruption_out", None, "Also write RSPC's corruption model to this file.")


def official_container(model) -> bool:
    """RVT and FAN checkpoints travel in timm's CheckpointSaver dict; the others bare."""
    from rspc_jax.models import fan
    from rspc_jax.models import rvt
    return isinstance(model, (rvt.RVT, fan.FAN))


def export(workdir: str, out: str, *, step=None, ema: bool = False, fmt: str = "auto",
           corruption_out=None) -> str:
    """Writes the export of run `workdir`; returns a one-line summary."""
    import tensorflow as tf

    from rspc_jax import checkpointing
    from rspc_jax import input_pipeline
    from rspc_jax import interop
    from rspc_jax import train

    config_path = os.path.join(workdir, "config.json")
    if not tf.io.gfile.exists(config_path):
        raise FileNotFoundError(f"{config_path} not found; --workdir must be a training run")
    with tf.io.gfile.GFile(config_path) as f:
        config = ml_collections.ConfigDict(json.load(f))
    step, state, meta = checkpointing.read_saved_state(
        os.path.join(workdir, "checkpoints"), step)
    if meta.get("model_name") != config.model_name:
        raise checkpointing.CheckpointMismatchError(
            f"checkpoint step {step} holds {meta.get('model_name')!r}, config.json says "
            f"{config.model_name!r}")
    model = train.build_model(config, input_pipeline.dataset_spec(config.dataset).num_classes)
    has_ema = bool(state.get("ema_params"))
    if ema and not has_ema:
        raise ValueError(f"run {workdir} kept no EMA (ema_decay = {config.ema_decay}); "
                         "export without --ema")
    batch_stats = state.get("batch_stats") or {}
    raw = interop.export_state_dict(dict(params=state["params"], batch_stats=batch_stats))
    averaged = (interop.export_state_dict(dict(params=state["ema_params"], batch_stats=batch_stats))
                if has_ema else None)
    chosen = averaged if ema else raw
    safetensors = fmt == "safetensors" or (fmt == "auto" and out.endswith(".safetensors"))
    if safetensors:
        interop.save_safetensors(out, chosen, metadata=dict(
            arch=config.model_name, step=str(step), weights="ema" if ema else "raw"))
        what = "state dict"
    elif official_container(model):
        payload = dict(state_dict=raw, arch=config.model_name)
        if has_ema:
            payload["state_dict_ema"] = averaged
        interop.save_torch(out, payload)
        what = "{'state_dict'" + (", 'state_dict_ema'" if has_ema else "") + ", 'arch'}"
    else:
        interop.save_torch(out, chosen)
        what = "state dict"
    summary = (f"Exported {config.model_name} step {step} ({'EMA' if ema else 'raw'} weights, "
               f"{len(chosen)} tensors) as {what} to {out}")
    if corruption_out:
        if not state.get("occ_params"):
            raise ValueError(f"run {workdir} trained without RSPC: it has no corruption model")
        occ = interop.export_state_dict(dict(params=state["occ_params"]))
        if corruption_out.endswith(".safetensors"):
            interop.save_safetensors(corruption_out, occ, metadata=dict(step=str(step)))
        else:
            interop.save_torch(corruption_out, dict(state_dict=occ, arch="patchocclusion"))
        summary += f"; corruption model ({', '.join(occ)}) to {corruption_out}"
    return summary


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.ERROR)  # orbax logs every read (and read-only mode)
    print(export(_WORKDIR.value, _OUT.value, step=_STEP.value, ema=_EMA.value, fmt=_FORMAT.value,
                 corruption_out=_CORRUPTION_OUT.value), flush=True)


if __name__ == "__main__":
    app.run(main)
