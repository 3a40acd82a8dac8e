"""Training: config defaults, setup (checks, model, settings, jitted step), the train
step, the loop, optimizers, adversarial training, mixup, patch-wise augmentation,
ablations and metric reporting."""
