"""Triton kernels, one file per family with its launcher. This package and backend.py are imported with
fastsoftmax; the kernel modules on first use (backend.kernels)."""
