// fastsoftmax's one launch call, for both backends, and a leaf: a prepared launch's address, a stream and the
// call's addresses go in (integers only: it reads no Python object, name or module), a launch comes out.
// It takes a prepared launch (launch.py's
// Desc: function, grid, block, shared memory, cluster size, the kernel's argument bytes, and the byte offsets
// where each of the call's addresses goes), this call's stream and addresses, copies the argument bytes onto
// its stack, writes the addresses and calls cuLaunchKernel (cuLaunchKernelEx for a cluster). A Desc has up to
// MAX_ADDRESSES address slots, each filling one or more byte offsets (MAX_FILLS in all); a call passes exactly
// as many addresses as its Desc has slots. The prepared bytes are only read, so threads may launch the same
// Desc at once. Built on first use by launch.py with the C compiler (the one Triton builds its own launchers
// with). No CUDA headers: the few driver types are declared here (cuda.h's layouts, 64-bit).
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef int CUresult;
typedef struct {
    unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, smem;
    void* stream;
    void* attrs;
    unsigned num_attrs;
} LaunchConfig;  // CUlaunchConfig
typedef struct {
    int id;
    char pad[4];
    unsigned x, y, z;
    char rest[52];
} ClusterAttribute;  // CUlaunchAttribute holding CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION (4)
typedef CUresult (*LaunchKernel)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                 void*, void**, void**);
typedef CUresult (*LaunchKernelEx)(const LaunchConfig*, void*, void**, void**);

#define MAX_PARAMS 64
#define MAX_BYTES 1024
#define MAX_ADDRESSES 16
#define MAX_FILLS 32

typedef struct {  // launch.py's Desc, field for field
    unsigned long long function;
    unsigned grid[3], block, smem, cluster, n_params, n_bytes, n_slots, n_fills;
    unsigned offsets[MAX_PARAMS];     // each parameter's offset in bytes
    unsigned fill_offset[MAX_FILLS];  // where an address goes (8 bytes at this offset in bytes) ...
    unsigned fill_slot[MAX_FILLS];    // ... and which of the call's addresses it is
    unsigned char bytes[MAX_BYTES];
} Desc;

static LaunchKernel launch_kernel;
static LaunchKernelEx launch_kernel_ex;

// libcuda on the first launch (importing the module needs no driver: CPU tests check its Desc).
static int load_driver(void) {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        PyErr_SetString(PyExc_RuntimeError, "fastlaunch: cannot open libcuda.so.1");
        return -1;
    }
    LaunchKernel k = (LaunchKernel)dlsym(lib, "cuLaunchKernel");
    LaunchKernelEx kx = (LaunchKernelEx)dlsym(lib, "cuLaunchKernelEx");
    if (!k || !kx) {
        PyErr_SetString(PyExc_RuntimeError, "fastlaunch: libcuda lacks a driver call fastlaunch makes");
        return -1;
    }
    launch_kernel_ex = kx;
    launch_kernel = k;  // last: a thread that sees it set sees both
    return 0;
}

// The launch itself: d's bytes with the addresses written in, on the stream. Returns 0 with *result set to
// the driver's CUresult, or -1 with a Python error (not a prepared Desc, no driver).
static int launch_desc(const Desc* d, unsigned long long stream, const unsigned long long* addr, size_t n_addr,
                       CUresult* result) {
    if (!d || d->n_bytes > MAX_BYTES || d->n_params > MAX_PARAMS || d->n_slots > MAX_ADDRESSES ||
        d->n_fills > MAX_FILLS) {
        PyErr_SetString(PyExc_ValueError, "fastlaunch: not a prepared Desc");
        return -1;
    }
    if (n_addr != d->n_slots) {
        PyErr_Format(PyExc_TypeError, "fastlaunch: this launch takes %u addresses, got %zd", d->n_slots,
                     (Py_ssize_t)n_addr);
        return -1;
    }
    *result = 0;
    if (d->grid[0] == 0 || d->grid[1] == 0 || d->grid[2] == 0) return 0;  // nothing to run
    if (!launch_kernel && load_driver() < 0) return -1;
    _Alignas(16) unsigned char buf[MAX_BYTES];
    void* params[MAX_PARAMS];
    memcpy(buf, d->bytes, d->n_bytes);
    for (unsigned i = 0; i < d->n_fills; ++i) {
        if (d->fill_slot[i] >= d->n_slots || d->fill_offset[i] + 8 > d->n_bytes) {
            PyErr_SetString(PyExc_ValueError, "fastlaunch: not a prepared Desc");
            return -1;
        }
        memcpy(buf + d->fill_offset[i], &addr[d->fill_slot[i]], 8);
    }
    for (unsigned i = 0; i < d->n_params; ++i) params[i] = buf + d->offsets[i];
    CUresult r;
    Py_BEGIN_ALLOW_THREADS;
    if (d->cluster == 1) {
        r = launch_kernel((void*)(uintptr_t)d->function, d->grid[0], d->grid[1], d->grid[2], d->block, 1, 1,
                          d->smem, (void*)(uintptr_t)stream, params, NULL);
    } else {
        ClusterAttribute attr;
        memset(&attr, 0, sizeof attr);
        attr.id = 4;
        attr.x = d->cluster;
        attr.y = attr.z = 1;
        LaunchConfig cfg = {d->grid[0], d->grid[1], d->grid[2], d->block, 1, 1, d->smem,
                            (void*)(uintptr_t)stream, &attr, 1};
        r = launch_kernel_ex(&cfg, (void*)(uintptr_t)d->function, params, NULL);
    }
    Py_END_ALLOW_THREADS;
    *result = r;
    return 0;
}

// launch(desc_address, stream, address_0, ..., address_{n_slots - 1}) -> CUresult
static PyObject* launch(PyObject* self, PyObject* const* args, Py_ssize_t n) {
    if (n < 2) {
        PyErr_SetString(PyExc_TypeError, "launch(desc, stream, *addresses): at least the Desc and the stream");
        return NULL;
    }
    unsigned long long desc = PyLong_AsUnsignedLongLong(args[0]);
    if (desc == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    unsigned long long stream = PyLong_AsUnsignedLongLong(args[1]);
    if (stream == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    unsigned long long addr[MAX_ADDRESSES];
    if (n - 2 > MAX_ADDRESSES) {
        PyErr_Format(PyExc_TypeError, "fastlaunch: at most %d addresses, got %zd", MAX_ADDRESSES, n - 2);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n - 2; ++i) {
        addr[i] = PyLong_AsUnsignedLongLong(args[2 + i]);
        if (addr[i] == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    }
    CUresult r;
    if (launch_desc((const Desc*)(uintptr_t)desc, stream, addr, (size_t)(n - 2), &r) < 0) return NULL;
    return PyLong_FromLong(r);
}

static PyObject* desc_size(PyObject* self, PyObject* unused) { return PyLong_FromSize_t(sizeof(Desc)); }

// (MAX_PARAMS, MAX_BYTES, MAX_ADDRESSES, MAX_FILLS), for launch.py's check that it builds Descs alike
static PyObject* limits(PyObject* self, PyObject* unused) {
    return Py_BuildValue("(IIII)", MAX_PARAMS, MAX_BYTES, MAX_ADDRESSES, MAX_FILLS);
}

// The driver structures as compiled here: (sizeof(ClusterAttribute), offsetof(x), sizeof(LaunchConfig),
// offsetof(smem), offsetof(stream), offsetof(attrs), offsetof(num_attrs)), for tests against cuda.h's.
static PyObject* driver_layout(PyObject* self, PyObject* unused) {
    return Py_BuildValue("(nnnnnnn)", (Py_ssize_t)sizeof(ClusterAttribute), (Py_ssize_t)offsetof(ClusterAttribute, x),
                         (Py_ssize_t)sizeof(LaunchConfig), (Py_ssize_t)offsetof(LaunchConfig, smem),
                         (Py_ssize_t)offsetof(LaunchConfig, stream), (Py_ssize_t)offsetof(LaunchConfig, attrs),
                         (Py_ssize_t)offsetof(LaunchConfig, num_attrs));
}

static PyMethodDef methods[] = {
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL,
     "launch(desc, stream, *addresses) -> CUresult (as many addresses as the Desc has slots)"},
    {"desc_size", desc_size, METH_NOARGS, "sizeof(Desc), for launch.py's check of its layout"},
    {"limits", limits, METH_NOARGS, "(MAX_PARAMS, MAX_BYTES, MAX_ADDRESSES, MAX_FILLS)"},
    {"driver_layout", driver_layout, METH_NOARGS, "sizes and offsets of the driver structures used here"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "fastlaunch", NULL, -1, methods};

PyMODINIT_FUNC PyInit_fastlaunch(void) { return PyModule_Create(&module); }
