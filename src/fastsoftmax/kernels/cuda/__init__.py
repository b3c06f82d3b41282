"""The CUDA C backend: softmax.cu (package data) compiled at run time by NVRTC (build.py), launched through
kernels/launch.py (fastlaunch.c) on torch's current stream (kernels.py). Its backend module is imported with
the package; NVRTC and the cubins are touched on first use only."""
