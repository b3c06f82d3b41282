// fastsoftmax's launch call: one C function that takes a prepared launch (cuda/launch.py's Desc: function,
// grid, block, shared memory, cluster size, the kernel's argument bytes and where the tensors' addresses
// go), this call's stream and addresses (x, y, dy, a workspace), copies the argument bytes onto its stack,
// writes the addresses and calls cuLaunchKernel (cuLaunchKernelEx for a cluster). Six integers parsed per
// call; the prepared bytes are only read, so threads may launch the same Desc at once. Built on first use by launch.py with the C
// compiler Triton uses too; without one, launch.py launches through ctypes instead.
// No CUDA headers: the few driver types are declared here (cuda.h's layouts, 64-bit).
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
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
#define MAX_SLOTS 4

typedef struct {  // launch.py's Desc, field for field
    unsigned long long function;
    unsigned grid[3], block, smem, cluster, n_params, n_bytes;
    unsigned offsets[MAX_PARAMS];
    int slots[4][MAX_SLOTS];  // byte offsets where x's, y's, dy's, the workspace's address go; -1: none
    unsigned char bytes[MAX_BYTES];
} Desc;

static LaunchKernel launch_kernel;
static LaunchKernelEx launch_kernel_ex;

// libcuda on the first launch (importing the module needs no driver: CPU tests check its Desc size).
static int load_driver(void) {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        PyErr_SetString(PyExc_RuntimeError, "fastlaunch: cannot open libcuda.so.1");
        return -1;
    }
    launch_kernel = (LaunchKernel)dlsym(lib, "cuLaunchKernel");
    launch_kernel_ex = (LaunchKernelEx)dlsym(lib, "cuLaunchKernelEx");
    if (!launch_kernel || !launch_kernel_ex) {
        PyErr_SetString(PyExc_RuntimeError, "fastlaunch: libcuda lacks cuLaunchKernel or cuLaunchKernelEx");
        return -1;
    }
    return 0;
}

static void fill(unsigned char* buf, const int* slots, unsigned long long v) {
    for (int i = 0; i < MAX_SLOTS && slots[i] >= 0; ++i) memcpy(buf + slots[i], &v, 8);
}

// launch(desc_address, stream, x, y, dy, workspace addresses) -> CUresult
static PyObject* launch(PyObject* self, PyObject* const* args, Py_ssize_t n) {
    if (n != 6) {
        PyErr_SetString(PyExc_TypeError, "launch(desc, stream, x, y, dy, workspace): six integers");
        return NULL;
    }
    unsigned long long v[6];
    for (int i = 0; i < 6; ++i) {
        v[i] = PyLong_AsUnsignedLongLong(args[i]);
        if (v[i] == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    }
    if (!launch_kernel && load_driver() < 0) return NULL;
    const Desc* d = (const Desc*)(uintptr_t)v[0];
    if (d->n_bytes > MAX_BYTES || d->n_params > MAX_PARAMS) {
        PyErr_SetString(PyExc_ValueError, "fastlaunch: not a prepared Desc");
        return NULL;
    }
    unsigned char buf[MAX_BYTES];
    void* params[MAX_PARAMS];
    memcpy(buf, d->bytes, d->n_bytes);
    for (int k = 0; k < 4; ++k) fill(buf, d->slots[k], v[2 + k]);
    for (unsigned i = 0; i < d->n_params; ++i) params[i] = buf + d->offsets[i];
    CUresult r;
    Py_BEGIN_ALLOW_THREADS;
    if (d->cluster == 1) {
        r = launch_kernel((void*)(uintptr_t)d->function, d->grid[0], d->grid[1], d->grid[2], d->block, 1, 1,
                          d->smem, (void*)(uintptr_t)v[1], params, NULL);
    } else {
        ClusterAttribute attr;
        memset(&attr, 0, sizeof attr);
        attr.id = 4;
        attr.x = d->cluster;
        attr.y = attr.z = 1;
        LaunchConfig cfg = {d->grid[0], d->grid[1], d->grid[2], d->block, 1, 1, d->smem,
                            (void*)(uintptr_t)v[1], &attr, 1};
        r = launch_kernel_ex(&cfg, (void*)(uintptr_t)d->function, params, NULL);
    }
    Py_END_ALLOW_THREADS;
    return PyLong_FromLong(r);
}

static PyObject* desc_size(PyObject* self, PyObject* unused) { return PyLong_FromSize_t(sizeof(Desc)); }

static PyMethodDef methods[] = {
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL, "launch(desc, stream, x, y, dy, ws) -> CUresult"},
    {"desc_size", desc_size, METH_NOARGS, "sizeof(Desc), for launch.py's check of its layout"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "fastlaunch", NULL, -1, methods};

PyMODINIT_FUNC PyInit_fastlaunch(void) { return PyModule_Create(&module); }
