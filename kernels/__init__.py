"""Triton kernels, each beside a PyTorch reference and a dispatcher."""
