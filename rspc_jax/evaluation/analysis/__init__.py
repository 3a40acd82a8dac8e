"""Model-robustness analyses of Bhojanapalli et al. (ICCV'21) on any registered model:
layer correlations, lesions, restricted attention and the spatial grid attack
(`python -m rspc_jax.analyze`)."""
