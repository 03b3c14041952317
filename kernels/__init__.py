"""Triton kernels of fastpals, installed as ``fastpals.kernels``."""
