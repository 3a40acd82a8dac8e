"""Model-robustness analyses of Bhojanapalli et al. (ICCV'21) on any registered model, one
plug-in module each (see `evaluation.registry`): layer_correlation, lesion,
restricted_attention and spatial_attack, with their shared helpers (blocks,
attention_masks, similarity, spatial); `python -m rspc_jax.analyze` runs them."""
