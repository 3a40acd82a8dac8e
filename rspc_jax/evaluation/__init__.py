"""Robustness evaluation: protocols (metric definitions and constants), data sources,
attacks and the suites that `python -m rspc_jax.evaluate` runs."""
