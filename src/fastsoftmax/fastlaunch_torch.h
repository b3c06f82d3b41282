// The table of torch calls fastlaunch_torch.cpp hands fastlaunch.c in a capsule (named FT_CAPSULE), in C.
// FT_ABI changes with any change here: fastlaunch.c takes only a table of its own ABI and Meta size.
#ifndef FASTLAUNCH_TORCH_H
#define FASTLAUNCH_TORCH_H

#define FT_ABI 7
#define FT_CAPSULE "fastsoftmax.fastlaunch_torch.FtCalls"
#define FT_MAX_DIMS 8

enum { FT_SOFTMAX, FT_LOG_SOFTMAX, FT_SOFTMAX_BACKWARD, FT_LOG_SOFTMAX_BACKWARD };

typedef struct {
    int ndim, dtype;  // dtype: c10::ScalarType's number
    int cuda, device;  // device: the CUDA index, -1 on the CPU
    int requires_grad, contiguous;
    long long numel;
    unsigned long long address;
    long long sizes[FT_MAX_DIMS], strides[FT_MAX_DIMS];
} FtMeta;

typedef struct {
    int abi;
    int meta_size;  // sizeof(FtMeta) as the C++ side was built with
    int (*meta)(PyObject* t, FtMeta* m);
    int (*dtype_code)(PyObject* dtype);
    PyObject* (*empty_like)(PyObject* t, int dtype, unsigned long long* address);
    PyObject* (*cpu_op)(int op, PyObject* a, PyObject* b, long dim, int dtype, unsigned long long* address);
    PyObject* (*cpu_loss)(PyObject* logits, PyObject* target, long ignore_index, int reduction, double smoothing,
                          int graph);
    int (*eager)(void);  // 1: no torch.func transform, torch_dispatch mode or jit trace on this thread
    int (*grad_enabled)(void);  // torch.is_grad_enabled()
} FtCalls;

#endif
