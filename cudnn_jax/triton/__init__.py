"""Pallas kernels compiled by XLA through Triton on NVIDIA GPUs: the "triton" engines."""
