"""Tools above training and evaluation: the CLIs' shared start-up, the step and model
benchmarks and the small-scale study."""
