"""Kernels, installed as ``trillm.kernels``: a torch reference and a Triton kernel per op."""
