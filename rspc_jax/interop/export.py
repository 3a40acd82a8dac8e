"""Export a training run's weights for PyTorch (timm, the official RVT/FAN/RSPC code);
the CLI is `python -m rspc_jax.export`.

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

import os

import ml_collections

from rspc_jax import ConfigError, models
from rspc_jax.data import specs as datasets
from rspc_jax.interop import checkpoints, run_record, state_dicts
from rspc_jax.models import fan, rvt


def official_container(model) -> bool:
    """RVT and FAN checkpoints travel in timm's CheckpointSaver dict; the others bare."""
    return isinstance(model, (rvt.RVT, fan.FAN))


def _run_config(workdir: str) -> ml_collections.ConfigDict:
    """The config run `workdir` trains with (its config.json)."""
    config = run_record.read_json(os.path.join(workdir, run_record.CONFIG))
    if config is None:
        raise checkpoints.NoCheckpointError(
            f"{os.path.join(workdir, run_record.CONFIG)} not found: --workdir={workdir} is not "
            "a training run. Pass the --workdir that `python -m rspc_jax.main` trained into "
            "(relative paths are from the current directory)."
        )
    return ml_collections.ConfigDict(config)


def export(
    workdir: str, out: str, *, step=None, ema: bool = False, fmt: str = "auto", corruption_out=None
) -> str:
    """Writes the export of run `workdir`; returns a one-line summary, which says when the
    run's settings changed on the way (interop.run_record)."""
    safetensors = fmt == "safetensors" or (fmt == "auto" and out.endswith(".safetensors"))
    if not safetensors:  # missing torch is said before the checkpoint is read
        state_dicts.require_torch(out)
    if corruption_out and not corruption_out.endswith(".safetensors"):
        state_dicts.require_torch(corruption_out)
    config = _run_config(workdir)
    model = models.from_config(config, datasets.dataset_spec(config.dataset).num_classes)
    step, state, _ = checkpoints.read_model_state(
        os.path.join(workdir, "checkpoints"),
        step,
        model=model,
        model_name=config.model_name,
        image_size=config.image_size,
    )
    has_ema = bool(state.get("ema_params"))
    if ema and not has_ema:
        raise ConfigError(
            f"run {workdir} kept no EMA (ema_decay = {config.ema_decay}); export without --ema"
        )
    batch_stats = state.get("batch_stats") or {}
    raw = state_dicts.export_state_dict(dict(params=state["params"], batch_stats=batch_stats))
    averaged = (
        state_dicts.export_state_dict(
            dict(
                params=state["ema_params"],
                batch_stats=state.get("ema_batch_stats") or batch_stats,
            )
        )
        if has_ema
        else None
    )
    chosen = averaged if ema else raw
    if safetensors:
        state_dicts.save_safetensors(
            out,
            chosen,
            metadata=dict(arch=config.model_name, step=str(step), weights="ema" if ema else "raw"),
        )
        what = "state dict"
    elif official_container(model):
        payload = dict(state_dict=raw, arch=config.model_name)
        if has_ema:
            payload["state_dict_ema"] = averaged
        state_dicts.save_torch(out, payload)
        what = "{'state_dict'" + (", 'state_dict_ema'" if has_ema else "") + ", 'arch'}"
    else:
        state_dicts.save_torch(out, chosen)
        what = "state dict"
    summary = (
        f"Exported {config.model_name} step {step} ({'EMA' if ema else 'raw'} weights, "
        f"{len(chosen)} tensors) as {what} to {out}"
    )
    if corruption_out:
        if not state.get("corruption_params"):
            raise ConfigError(
                f"run {workdir} has no corruption model (it trained without RSPC, or with "
                f"rspc.selection={config.rspc.selection!r}, which builds none); drop "
                "--corruption_out"
            )
        corruption = state_dicts.export_state_dict(dict(params=state["corruption_params"]))
        if corruption_out.endswith(".safetensors"):
            state_dicts.save_safetensors(corruption_out, corruption, metadata=dict(step=str(step)))
        else:
            state_dicts.save_torch(
                corruption_out, dict(state_dict=corruption, arch="patchocclusion")
            )
        summary += f"; corruption model ({', '.join(corruption)}) to {corruption_out}"
    note = run_record.changes_note(workdir, step)
    return f"{summary}. Note: {note}" if note else summary
