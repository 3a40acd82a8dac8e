"""rspc_jax: RSPC (Guo, Stutz, Schiele, CVPR 2023) in JAX/Flax for TPU pods."""

__version__ = "0.1.0"
