"""Engines in plain JAX where the definition in ``cudnn_jax.reference`` would not scale."""
