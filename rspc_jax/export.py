"""Export a training run's weights for PyTorch (timm, the official RVT/FAN/RSPC code).

    python -m rspc_jax.export --workdir=DIR --out=rvt_ti_rspc.pth.tar
    python -m rspc_jax.export --workdir=DIR --ema --out=deit_s.safetensors

What each format holds: `rspc_jax.interop.export`.
"""

from absl import flags

from rspc_jax.tools import cli

_WORKDIR = cli.DEFINE_path(
    "workdir", None, "Training run to export (its config.json and checkpoints/).", required=True
)
_OUT = cli.DEFINE_path("out", None, "Output file.", required=True)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step; default: the latest.")
_EMA = flags.DEFINE_bool("ema", False, "Export the EMA weights (needs a run with ema_decay > 0).")
_FORMAT = flags.DEFINE_enum(
    "format",
    "auto",
    ["auto", "torch", "safetensors"],
    "'auto' = safetensors for a .safetensors --out, else torch.save.",
)
_CORRUPTION_OUT = cli.DEFINE_path(
    "corruption_out", None, "Also write RSPC's corruption model to this file."
)


def main(argv):
    cli.start(argv)
    from rspc_jax.interop import export

    print(
        export.export(
            _WORKDIR.value,
            _OUT.value,
            step=_STEP.value,
            ema=_EMA.value,
            fmt=_FORMAT.value,
            corruption_out=_CORRUPTION_OUT.value,
        ),
        flush=True,
    )


if __name__ == "__main__":
    cli.run(main)
