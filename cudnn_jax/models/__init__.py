"""Models built on cudnn_jax's Flax layers: ``gpt``, a small language model and its
sharded training."""
