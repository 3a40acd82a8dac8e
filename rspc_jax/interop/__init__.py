"""Weights in and out: orbax checkpoints of runs (`checkpoints`), PyTorch key layouts
(`layout`), state-dict import and files (`state_dicts`) and the export of runs (`export`)."""
