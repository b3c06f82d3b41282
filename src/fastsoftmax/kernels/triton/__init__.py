"""Triton kernels, one file per family with its launcher. Imported lazily by fastsoftmax.dispatch."""
