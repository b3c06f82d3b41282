"""The CUDA C backend: softmax.cu (package data) compiled at run time by NVRTC (build.py), launched through
cuda.bindings on torch's current stream (kernels.py). Imported only when backend="cuda" is used."""
