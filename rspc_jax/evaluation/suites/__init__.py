"""The evaluation suites, one plug-in module each (run, rows, figures; see
`evaluation.registry`): clean, corrupted_local, patch_occlusion, attention_stability and
adversarial on the run's own eval split; imagenet_c, imagenet_a, imagenet_r, imagenet_p,
cifar10_c and cifar100_c on released benchmark data."""
