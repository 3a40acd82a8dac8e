"""Robustness evaluation: protocols (metric definitions and constants), data sources,
attacks, and the suites and analyses (plug-ins named in `registry`) that one driver
(`run_suites`) runs for `python -m rspc_jax.evaluate` and `python -m rspc_jax.analyze`."""
