"""``python -m cudnn_jax``: what this machine gives cudnn_jax (extension, cuDNN, GPU, linked
kernels, each op's engines)."""

from cudnn_jax import _extension

print(_extension.report())
