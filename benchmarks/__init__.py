"""The speed laboratory beside the library: train-step benchmarks and their side-by-side
comparisons with timm's and the official code's steps, profiles, and layer and model
benchmarks. Run from the repository root (`python -m benchmarks.train_step ...`); the
library (rspc_jax/) never imports it (tests/test_architecture.py)."""
