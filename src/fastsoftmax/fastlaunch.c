// fastsoftmax's one launch call, for both backends: a C function that takes a prepared launch (launch.py's
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

#include "fastlaunch_torch.h"

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
typedef CUresult (*CtxGetCurrent)(void**);
typedef CUresult (*DeviceGet)(int*, int);
typedef CUresult (*PrimaryCtxRetain)(void**, int);

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
static CtxGetCurrent ctx_get_current;
static DeviceGet device_get;
static PrimaryCtxRetain primary_ctx_retain;

// libcuda on the first launch (importing the module needs no driver: CPU tests check its Desc).
static int load_driver(void) {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        PyErr_SetString(PyExc_RuntimeError, "fastlaunch: cannot open libcuda.so.1");
        return -1;
    }
    LaunchKernel k = (LaunchKernel)dlsym(lib, "cuLaunchKernel");
    LaunchKernelEx kx = (LaunchKernelEx)dlsym(lib, "cuLaunchKernelEx");
    ctx_get_current = (CtxGetCurrent)dlsym(lib, "cuCtxGetCurrent");
    device_get = (DeviceGet)dlsym(lib, "cuDeviceGet");
    primary_ctx_retain = (PrimaryCtxRetain)dlsym(lib, "cuDevicePrimaryCtxRetain");
    if (!k || !kx || !ctx_get_current || !device_get || !primary_ctx_retain) {
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

// ---- the eager replay's hot path (fastpath.py) ----------------------------------------------------------
// What a replayed call does on the host, in one C call: the checks that the call is a plain eager one, its
// cache key (the same tuple for the recording, made here too), the lookup, the output's allocation and the
// recorded launch. A small call's host time is mostly Python calls; here each of torch's probes is one C
// call. fastpath.configure() hands over torch's probes and the cache once; the caller checks
// torch.compiler.is_compiling() first (dynamo folds that call; it cannot trace this module).

static PyObject *g_tensor, *g_dtype_type, *g_cache, *g_grad_enabled, *g_functorch, *g_dispatch_len, *g_tracing,
    *g_autocast, *g_fwad, *g_heuristics, *g_knobs, *g_get_stream, *g_empty_like, *g_record, *g_loss_dtypes;
static PyObject *s_shape, *s_stride, *s_dtype, *s_get_device, *s_data_ptr, *s_is_cuda, *s_requires_grad,
    *s_level, *s_force, *s_enter, *s_exit, *s_calls, *s_native, *s_is_contiguous, *s_numel, *s_plans, *s_state,
    *s_last, *kw_dtype;

// torch's calls in C++ (fastlaunch_torch.cpp), or NULL where it could not be built: Python's probes then
static const FtCalls* ft;
static PyObject* ft_capsule;  // (holds the table)

// configure_torch(capsule or None): the table fastlaunch_torch.table() returns; before configure(), as calls
// are keyed otherwise with it (fastpath.py)
static PyObject* configure_torch(PyObject* self, PyObject* cap) {
    if (cap == Py_None) {
        ft = NULL;
        Py_CLEAR(ft_capsule);
        Py_RETURN_NONE;
    }
    const FtCalls* calls = (const FtCalls*)PyCapsule_GetPointer(cap, FT_CAPSULE);
    if (!calls) return NULL;
    if (calls->abi != FT_ABI || calls->meta_size != (int)sizeof(FtMeta)) {
        PyErr_Format(PyExc_RuntimeError, "fastlaunch_torch's table (ABI %d, Meta of %d bytes) is not this one's",
                     calls->abi, calls->meta_size);
        return NULL;
    }
    Py_INCREF(cap);
    Py_XSETREF(ft_capsule, cap);
    ft = calls;
    Py_RETURN_NONE;
}

static int configured(void) {
    if (g_cache) return 1;
    PyErr_SetString(PyExc_RuntimeError, "fastlaunch: configure() first");
    return 0;
}

// configure(tensor_type, dtype_type, cache, is_grad_enabled, functorch_active, dispatch_stack_len,
//           tracing_state, any_autocast, forward_ad_module, heuristics_module, triton_runtime_knobs,
//           current_raw_stream, empty_like, record, loss_dtypes)
static PyObject* configure(PyObject* self, PyObject* const* args, Py_ssize_t n) {
    PyObject** slots[] = {&g_tensor,  &g_dtype_type, &g_cache,      &g_grad_enabled, &g_functorch,
                          &g_dispatch_len, &g_tracing, &g_autocast, &g_fwad,   &g_heuristics,
                          &g_knobs,   &g_get_stream, &g_empty_like, &g_record,     &g_loss_dtypes};
    const Py_ssize_t want = (Py_ssize_t)(sizeof slots / sizeof slots[0]);
    if (n != want) {
        PyErr_Format(PyExc_TypeError, "configure takes %zd arguments, got %zd", want, n);
        return NULL;
    }
    if (!PyTuple_Check(args[want - 1])) {
        PyErr_SetString(PyExc_TypeError, "configure: loss_dtypes must be a tuple");
        return NULL;
    }
    if (!s_shape) {
        const char* names[] = {"shape", "stride", "dtype", "get_device", "data_ptr", "is_cuda", "requires_grad",
                               "_current_level", "_force", "launch_enter_hook", "launch_exit_hook", "calls",
                               "native", "is_contiguous", "numel", "_plans", "_state", "last"};
        PyObject** strs[] = {&s_shape,  &s_stride, &s_dtype, &s_get_device, &s_data_ptr, &s_is_cuda,
                             &s_requires_grad, &s_level, &s_force, &s_enter, &s_exit, &s_calls,
                             &s_native, &s_is_contiguous, &s_numel, &s_plans, &s_state, &s_last};
        for (size_t i = 0; i < sizeof names / sizeof names[0]; ++i)
            if (!(*strs[i] = PyUnicode_InternFromString(names[i]))) return NULL;
        if (!(kw_dtype = Py_BuildValue("(s)", "dtype"))) return NULL;
    }
    for (Py_ssize_t i = 0; i < want; ++i) {
        Py_INCREF(args[i]);
        Py_XSETREF(*slots[i], args[i]);
    }
    Py_RETURN_NONE;
}

// module.name, a new reference (NULL with an error): from the module's dict, a quarter of a generic getattr's
// cost, where it is there (monkeypatch writes there too); else the module's getattr
static PyObject* module_attr(PyObject* module, PyObject* name) {
    if (PyModule_CheckExact(module)) {
        PyObject* v = PyDict_GetItemWithError(PyModule_GetDict(module), name);
        if (v) return Py_NewRef(v);
        if (PyErr_Occurred()) return NULL;
    }
    return PyObject_GetAttr(module, name);
}

// This thread's dict of heuristics._state (a threading.local: its __dict__ is the thread's own), borrowed: kept
// in the thread state's dict, which lets it go with the thread; NULL where there is none (an error may be set)
static PyObject* state_dict(void) {
    static PyObject *state, *key;  // (heuristics._state, never replaced; the thread state dict's key)
    PyObject* ts = PyThreadState_GetDict();
    if (!ts || (!key && !(key = PyUnicode_InternFromString("fastsoftmax.heuristics._state")))) return NULL;
    PyObject* d = PyDict_GetItemWithError(ts, key);
    if (d || PyErr_Occurred()) return d;
    if (!state && !(state = module_attr(g_heuristics, s_state))) return NULL;
    if (!(d = PyObject_GetAttrString(state, "__dict__"))) return NULL;
    const int t = PyDict_SetItem(ts, key, d);
    Py_DECREF(d);
    return t < 0 ? NULL : d;
}

// heuristics.record(plan) without its Python frame: the thread's last plan (heuristics._state.last) set in
// the thread's dict of _state (a third of a setattr's cost), or record() itself called while a
// heuristics.plans() block collects them. 0, or -1 with an error.
static int record_plan(PyObject* plan) {
    PyObject* plans = module_attr(g_heuristics, s_plans);
    if (!plans) return -1;
    PyObject* d = plans == Py_None ? state_dict() : NULL;
    Py_DECREF(plans);
    if (!d) {
        if (PyErr_Occurred()) return -1;
        PyObject* r = PyObject_Vectorcall(g_record, &plan, 1, NULL);
        Py_XDECREF(r);
        return r ? 0 : -1;
    }
    return PyDict_SetItem(d, s_last, plan);
}

static int call_truthy(PyObject* f) {
    PyObject* r = PyObject_CallNoArgs(f);
    if (!r) return -1;
    int t = PyObject_IsTrue(r);
    Py_DECREF(r);
    return t;
}

static int attr_is(PyObject* o, PyObject* name, PyObject* value) {
    PyObject* a = module_attr(o, name);
    if (!a) return -1;
    int is = a == value;
    Py_DECREF(a);
    return is;
}

// torch.is_grad_enabled(): 1, 0, or -1 with an error
static int grad_mode(void) {
    const FtCalls* calls = ft;
    return calls ? calls->grad_enabled() : call_truthy(g_grad_enabled);
}

// t.requires_grad and torch.is_grad_enabled(): 1, 0, or -1 with an error
static int needs_grad(PyObject* t) {
    int rg = attr_is(t, s_requires_grad, Py_True);
    return rg <= 0 ? rg : grad_mode();
}

// 1 when no torch.func transform, forward-mode AD level, dispatch mode or jit trace is under way
// (compose.eager's checks but torch.compile's, which callers make); 0 otherwise; -1 with an error.
static int eager_state(void) {
    int t;
    const FtCalls* calls = ft;  // (through fastlaunch_torch: one call for three of torch's Python bindings)
    if (calls) {
        if (!calls->eager()) return 0;
    } else if ((t = call_truthy(g_functorch)) != 0) {
        return t < 0 ? -1 : 0;
    }
    PyObject* lvl = module_attr(g_fwad, s_level);
    if (!lvl) return -1;
    long level = PyLong_AsLong(lvl);
    Py_DECREF(lvl);
    if (level == -1 && PyErr_Occurred()) return -1;
    if (level >= 0) return 0;
    if (calls) return 1;
    if ((t = call_truthy(g_dispatch_len)) != 0) return t < 0 ? -1 : 0;
    PyObject* tr = PyObject_CallNoArgs(g_tracing);
    if (!tr) return -1;
    t = tr == Py_None;
    Py_DECREF(tr);
    return t;
}

// 1 when only plain eager calls can be under way: eager_state's, and no autocast, no heuristics.force block,
// no launch hook registered with Triton (fastpath.py's checks, in its order); 0 otherwise; -1 with an error.
static int plain_state(void) {
    int t;
    if ((t = eager_state()) != 1) return t;
    if ((t = call_truthy(g_autocast)) != 0) return t < 0 ? -1 : 0;
    if ((t = attr_is(g_heuristics, s_force, Py_None)) != 1) return t;
    PyObject* hooks[] = {s_enter, s_exit};
    for (int i = 0; i < 2; ++i) {  // a hook chain with no calls (or None) is idle; a plain callable is not
        PyObject* h = PyObject_GetAttr(g_knobs, hooks[i]);
        if (!h) return -1;
        if (h == Py_None) {
            Py_DECREF(h);
            continue;
        }
        PyObject* calls = PyObject_GetAttr(h, s_calls);
        Py_DECREF(h);
        if (!calls) {
            PyErr_Clear();
            return 0;
        }
        t = PyObject_IsTrue(calls);
        Py_DECREF(calls);
        if (t != 0) return t < 0 ? -1 : 0;
    }
    return 1;
}

static PyObject* call_method(PyObject* o, PyObject* name) { return PyObject_CallMethodNoArgs(o, name); }

// o.data_ptr() as an integer; 0 with an error set on failure (check PyErr_Occurred)
static unsigned long long address_of(PyObject* o) {
    PyObject* p = call_method(o, s_data_ptr);
    if (!p) return 0;
    unsigned long long a = PyLong_AsUnsignedLongLong(p);
    Py_DECREF(p);
    return a == (unsigned long long)-1 && PyErr_Occurred() ? 0 : a;
}

static int is_cuda(PyObject* t) { return attr_is(t, s_is_cuda, Py_True); }

#define MAX_DEVICES 64
static void* primary_ctx[MAX_DEVICES];

// 1 when device dev's primary context (torch's) is current on this thread, the one whose modules hold the
// recorded kernels (torch's current device is dev); 0 when another context or none is; -1 with an error.
static int device_current(long dev) {
    if (dev < 0 || dev >= MAX_DEVICES) return 0;
    if (!launch_kernel && load_driver() < 0) return -1;
    void* cur = NULL;
    if (ctx_get_current(&cur) != 0 || !cur) return 0;
    if (!primary_ctx[dev]) {  // (retained for the process, as torch holds it)
        int d;
        void* ctx = NULL;
        if (device_get(&d, (int)dev) != 0 || primary_ctx_retain(&ctx, d) != 0) return 0;
        primary_ctx[dev] = ctx;
    }
    return cur == primary_ctx[dev];
}

static int is_number(PyObject* o) { return PyLong_CheckExact(o) || PyFloat_CheckExact(o); }

#include "fastlaunch_cpu.c"  // the CPU's direct path (cpu_fast), on the probes above

// A softmax-family call's arguments, probed once for its key (fastpath.key) and its replay
typedef struct {
    unsigned long long px, pd;  // x's and dy's addresses (pd 0 without dy)
    long device;                // x's CUDA index, -1 on the CPU
    int x_grad, d_grad;         // their requires_grad (0 where softmax_fast asked before the key)
} Probe;

// The key of a softmax-family call through Python's probes (no fastlaunch_torch): the tuple (x.shape,
// x.stride(), x.dtype, x.get_device(), x's address mod 16, dim, dtype, log, backend) and for a backward
// (dy.stride(), dy.dtype, dy's address mod 16, (dy's - x's address) mod 16, dy.shape, dy.get_device()).
// Py_None (a new reference) when the call cannot be keyed.
static PyObject* tuple_softmax_key(PyObject* x, PyObject* d, PyObject* dim, PyObject* dtype, PyObject* log,
                                   PyObject* backend, int cuda_only, Probe* p) {
    if (!PyUnicode_CheckExact(backend)) Py_RETURN_NONE;
    if (dtype != Py_None && !PyObject_TypeCheck(dtype, (PyTypeObject*)g_dtype_type)) Py_RETURN_NONE;
    if (cuda_only) {
        int c = is_cuda(x);
        if (c <= 0) return c < 0 ? NULL : Py_NewRef(Py_None);
        if (d != Py_None && (c = is_cuda(d)) <= 0) return c < 0 ? NULL : Py_NewRef(Py_None);
    }
    unsigned long long px = address_of(x), pd = 0;
    if (!px) return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);  // no storage: the full path raises
    if (d != Py_None && !(pd = address_of(d))) return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    PyObject* k = PyTuple_New(d == Py_None ? 9 : 15);
    if (!k) return NULL;
    PyObject* items[15];
    items[0] = PyObject_GetAttr(x, s_shape);
    items[1] = call_method(x, s_stride);
    items[2] = PyObject_GetAttr(x, s_dtype);
    items[3] = call_method(x, s_get_device);
    items[4] = PyLong_FromUnsignedLongLong(px % 16);
    items[5] = Py_NewRef(dim);
    items[6] = Py_NewRef(dtype);
    items[7] = Py_NewRef(log);
    items[8] = Py_NewRef(backend);
    Py_ssize_t n = 9;
    if (d != Py_None) {
        items[9] = call_method(d, s_stride);
        items[10] = PyObject_GetAttr(d, s_dtype);
        items[11] = PyLong_FromUnsignedLongLong(pd % 16);
        items[12] = PyLong_FromUnsignedLongLong((pd - px) % 16);
        items[13] = PyObject_GetAttr(d, s_shape);
        items[14] = call_method(d, s_get_device);
        n = 15;
    }
    int bad = 0;
    for (Py_ssize_t i = 0; i < n; ++i) {
        if (!items[i]) bad = 1;
        PyTuple_SET_ITEM(k, i, items[i] ? items[i] : Py_NewRef(Py_None));
    }
    if (bad || ((p->device = PyLong_AsLong(items[3])) == -1 && PyErr_Occurred())) {
        Py_DECREF(k);
        return NULL;
    }
    p->px = px, p->pd = pd;
    p->x_grad = p->d_grad = 0;  // (softmax_fast asked needs_grad before)
    return k;
}

static const char* const BACKENDS[] = {"auto", "triton", "cuda", "torch"};

// The same key through torch's C++ calls (fastlaunch_torch.cpp): the same fields packed into bytes, the
// output dtype as its ScalarType number and the backend as its index in BACKENDS (another string: no key;
// the full path raises). A process keys every call one way: fastpath configures fastlaunch_torch first.
static PyObject* packed_softmax_key(PyObject* x, PyObject* d, PyObject* dim, PyObject* dtype, PyObject* log,
                                    PyObject* backend, int cuda_only, Probe* p, const FtMeta* x_meta) {
    int b = -1;
    if (PyUnicode_CheckExact(backend))
        for (int i = 0; i < 4 && b < 0; ++i)
            if (PyUnicode_CompareWithASCIIString(backend, BACKENDS[i]) == 0) b = i;
    int dt = dtype == Py_None ? -1 : ft->dtype_code(dtype);
    if (b < 0 || (dtype != Py_None && dt < 0) || (log != Py_True && log != Py_False)) Py_RETURN_NONE;
    int overflow;
    long dm = PyLong_AsLongAndOverflow(dim, &overflow);
    if (overflow || (dm == -1 && PyErr_Occurred())) return NULL;
    FtMeta mx, md;
    if (x_meta)
        mx = *x_meta;
    else if (!ft->meta(x, &mx))
        Py_RETURN_NONE;  // (no storage, a wrapper: the full path)
    if (!mx.address) Py_RETURN_NONE;
    if (d != Py_None && (!ft->meta(d, &md) || !md.address)) Py_RETURN_NONE;
    if (cuda_only && (!mx.cuda || (d != Py_None && !md.cuda))) Py_RETURN_NONE;
    long long k[2 * (4 + 2 * FT_MAX_DIMS) + 5];  // per tensor ndim, sizes, strides, dtype, device, address; then 5
    int n = 0;
    FtMeta* ms[2] = {&mx, &md};
    for (int t = 0; t < (d == Py_None ? 1 : 2); ++t) {
        const FtMeta* m = ms[t];
        k[n++] = m->ndim;
        for (int i = 0; i < m->ndim; ++i) k[n++] = m->sizes[i];
        for (int i = 0; i < m->ndim; ++i) k[n++] = m->strides[i];
        k[n++] = m->dtype;
        k[n++] = m->device;
        k[n++] = (long long)(m->address % 16);
    }
    if (d != Py_None) k[n++] = (long long)((md.address - mx.address) % 16);
    k[n++] = dm;
    k[n++] = dt;
    k[n++] = log == Py_True;
    k[n++] = b;
    p->px = mx.address, p->pd = d == Py_None ? 0 : md.address;
    p->device = mx.device;
    p->x_grad = mx.requires_grad, p->d_grad = d == Py_None ? 0 : md.requires_grad;
    return PyBytes_FromStringAndSize((const char*)k, (Py_ssize_t)(n * sizeof k[0]));
}

// The key of a softmax-family call (x_meta: x's, where the caller has it): Py_None (a new reference) when it
// cannot be keyed.
static PyObject* make_softmax_key(PyObject* x, PyObject* d, PyObject* dim, PyObject* dtype, PyObject* log,
                                  PyObject* backend, int cuda_only, Probe* p, const FtMeta* x_meta) {
    if (Py_TYPE(x) != (PyTypeObject*)g_tensor || !PyLong_CheckExact(dim)) Py_RETURN_NONE;
    if (d != Py_None && Py_TYPE(d) != (PyTypeObject*)g_tensor) Py_RETURN_NONE;
    if (ft) return packed_softmax_key(x, d, dim, dtype, log, backend, cuda_only, p, x_meta);
    return tuple_softmax_key(x, d, dim, dtype, log, backend, cuda_only, p);
}

// tensor_key(t) -> what a replay keys a tensor by: (t.shape, t.stride(), t.dtype, its address mod 16), or
// through fastlaunch_torch its dims, strides, dtype, device and address mod 16 packed into bytes
static PyObject* tensor_key(PyObject* self, PyObject* t) {
    if (!configured()) return NULL;
    FtMeta m;
    if (ft && Py_TYPE(t) == (PyTypeObject*)g_tensor && ft->meta(t, &m)) {
        long long k[4 + 2 * FT_MAX_DIMS];
        int n = 0;
        k[n++] = m.ndim;
        for (int i = 0; i < m.ndim; ++i) k[n++] = m.sizes[i];
        for (int i = 0; i < m.ndim; ++i) k[n++] = m.strides[i];
        k[n++] = m.dtype, k[n++] = m.device, k[n++] = (long long)(m.address % 16);
        return PyBytes_FromStringAndSize((const char*)k, (Py_ssize_t)(n * sizeof k[0]));
    }
    unsigned long long a = address_of(t);
    if (!a && PyErr_Occurred()) return NULL;
    PyObject* shape = PyObject_GetAttr(t, s_shape);
    PyObject* stride = shape ? call_method(t, s_stride) : NULL;
    PyObject* dtype = stride ? PyObject_GetAttr(t, s_dtype) : NULL;
    PyObject* k = dtype ? Py_BuildValue("(OOOK)", shape, stride, dtype, a % 16) : NULL;
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    Py_XDECREF(dtype);
    return k;
}

// softmax_key(x, dy_or_None, dim, dtype, log, backend[, cuda_only=True]) -> the call's key, or None
static PyObject* softmax_key(PyObject* self, PyObject* const* args, Py_ssize_t n) {
    if (!configured()) return NULL;
    if (n != 6 && n != 7) {
        PyErr_SetString(PyExc_TypeError, "softmax_key(x, dy, dim, dtype, log, backend[, cuda_only])");
        return NULL;
    }
    int cuda_only = n == 7 ? PyObject_IsTrue(args[6]) : 1;
    if (cuda_only < 0) return NULL;
    Probe p;
    return make_softmax_key(args[0], args[1], args[2], args[3], args[4], args[5], cuda_only, &p, NULL);
}

// a tensor's requires_grad as probed, and torch.is_grad_enabled(): 1, 0, or -1 with an error
static int probed_grad(int requires_grad) { return requires_grad ? grad_mode() : 0; }

// softmax_fast(x, dy_or_None, dim, dtype, log, backend) -> the replayed output, or None (the full path runs):
// fastpath.py's replay of a softmax-family call seen before; for a tensor not on CUDA, the CPU's direct path
// (fastlaunch_cpu.c) once configure_cpu() has run.
static PyObject* softmax_fast(PyObject* self, PyObject* const* args, Py_ssize_t n) {
    if (!configured()) return NULL;
    if (n != 6) {
        PyErr_SetString(PyExc_TypeError, "softmax_fast(x, dy, dim, dtype, log, backend)");
        return NULL;
    }
    PyObject *x = args[0], *d = args[1];
    if (Py_TYPE(x) != (PyTypeObject*)g_tensor) Py_RETURN_NONE;
    int t;
    FtMeta m;
    const int torch_cpp = ft != NULL;  // (read once: the build's thread may set it while Python code runs below)
    if (torch_cpp) {  // (a torch.func wrapper has no storage: cpu_fast's first check refuses it)
        if (!ft->meta(x, &m)) return cpu_fast(x, d, args[2], args[3], args[4], args[5], NULL);
        if (!m.cuda) return cpu_fast(x, d, args[2], args[3], args[4], args[5], &m);
    } else {
        if ((t = is_cuda(x)) <= 0) return t < 0 ? NULL : cpu_fast(x, d, args[2], args[3], args[4], args[5], NULL);
        if ((t = needs_grad(x)) != 0 || (t = plain_state()) != 1) return t < 0 ? NULL : Py_NewRef(Py_None);
        if (d != Py_None && Py_TYPE(d) == (PyTypeObject*)g_tensor && (t = needs_grad(d)) != 0)
            return t < 0 ? NULL : Py_NewRef(Py_None);
    }
    Probe p;
    PyObject* key = make_softmax_key(x, d, args[2], args[3], args[4], args[5], 1, &p, torch_cpp ? &m : NULL);
    if (!key || key == Py_None) return key;
    PyObject *result = NULL, *entry = NULL, *native = NULL, *y = NULL, *st = NULL, *dev = NULL;
    if (!PyBytes_Check(key) && torch_cpp) {  // (keyed through Python after all: its grad was not asked)
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (torch_cpp && ((t = probed_grad(p.x_grad)) != 0 || (t = probed_grad(p.d_grad)) != 0 || (t = plain_state()) != 1)) {
        result = t < 0 ? NULL : Py_NewRef(Py_None);
        goto done;
    }
    entry = PyDict_GetItemWithError(g_cache, key);
    Py_XINCREF(entry);  // (held: Python code below may clear the cache)
    if (!entry) {
        result = PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
        goto done;
    }
    t = device_current(p.device);
    if (t <= 0) {  // another device is current: its context would not hold this kernel
        result = t < 0 ? NULL : Py_NewRef(Py_None);
        goto done;
    }
    if (!(dev = PyLong_FromLong(p.device))) goto done;
    if (!(native = PyObject_GetAttr(entry, s_native))) goto done;
    if (native == Py_None) {  // several launches or a workspace: the entry's own replay
        PyObject* a[3] = {x, d, dev};
        result = PyObject_Vectorcall(entry, a, 3, NULL);
        goto done;
    }
    // native: (Desc address, output dtype or None, plan)
    if (!PyTuple_Check(native) || PyTuple_GET_SIZE(native) != 3) {
        PyErr_SetString(PyExc_TypeError, "fastlaunch: a replay entry's native is not (desc, dtype, plan)");
        goto done;
    }
    unsigned long long desc = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(native, 0));
    if (desc == (unsigned long long)-1 && PyErr_Occurred()) goto done;
    PyObject* out_dtype = PyTuple_GET_ITEM(native, 1);
    unsigned long long py = 0;
    if (ft) {
        y = ft->empty_like(x, out_dtype == Py_None ? -1 : ft->dtype_code(out_dtype), &py);
    } else {
        if (out_dtype == Py_None) {
            y = PyObject_Vectorcall(g_empty_like, &x, 1, NULL);
        } else {
            PyObject* a[2] = {x, out_dtype};
            y = PyObject_Vectorcall(g_empty_like, a, 1, kw_dtype);
        }
        if (y) py = address_of(y);
    }
    if (!y || (!py && PyErr_Occurred())) goto done;
    if (py % 16) {  // never from torch's allocator; the recorded plan assumed an aligned output
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (!(st = PyObject_Vectorcall(g_get_stream, &dev, 1, NULL))) goto done;
    unsigned long long stream = PyLong_AsUnsignedLongLong(st);
    if (stream == (unsigned long long)-1 && PyErr_Occurred()) goto done;
    unsigned long long addr[4] = {p.px, py, p.pd, 0};
    CUresult r;
    if (launch_desc((const Desc*)(uintptr_t)desc, stream, addr, 4, &r) < 0) goto done;
    if (r != 0) {  // (no current context on this thread, say): the full path runs and reports
        result = Py_NewRef(Py_None);
        goto done;
    }
    PyObject* plan = PyTuple_GET_ITEM(native, 2);
    if (record_plan(plan) < 0) goto done;
    result = Py_NewRef(y);
done:
    Py_DECREF(key);
    Py_XDECREF(entry);
    Py_XDECREF(dev);
    Py_XDECREF(native);
    Py_XDECREF(y);
    Py_XDECREF(st);
    return result;
}

// loss_key's tuple through torch's C++ calls: (logits' dims, then target's, packed into bytes), their dtypes
// as ScalarType numbers in place of logits.shape, logits.dtype, target.shape and target.dtype; the rest as
// loss_key's. args: loss_key's, checked there up to the tensors.
static PyObject* packed_loss_key(PyObject* const* args, int cuda_only) {
    PyObject *x = args[0], *tg = args[1];
    FtMeta mx, mt;
    if (!ft->meta(x, &mx) || !ft->meta(tg, &mt) || !mx.address || !mt.address || !mx.numel) Py_RETURN_NONE;
    if ((cuda_only && (!mx.cuda || !mt.cuda)) || !mx.contiguous || !mt.contiguous) Py_RETURN_NONE;
    int known = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(g_loss_dtypes); ++i)
        known |= ft->dtype_code(PyTuple_GET_ITEM(g_loss_dtypes, i)) == mx.dtype;
    if (!known) Py_RETURN_NONE;
    int t = plain_state();
    if (t != 1) return t < 0 ? NULL : Py_NewRef(Py_None);
    int grad = probed_grad(mx.requires_grad);
    if (grad < 0) return NULL;
    if (cuda_only && (t = device_current(mx.device)) != 1) return t < 0 ? NULL : Py_NewRef(Py_None);
    long long dims[2 * FT_MAX_DIMS + 2];
    int n = 0;
    dims[n++] = mx.ndim;
    for (int i = 0; i < mx.ndim; ++i) dims[n++] = mx.sizes[i];
    dims[n++] = mt.ndim;
    for (int i = 0; i < mt.ndim; ++i) dims[n++] = mt.sizes[i];
    PyObject* items[16];
    items[0] = PyBytes_FromStringAndSize((const char*)dims, (Py_ssize_t)(n * sizeof dims[0]));
    items[1] = PyLong_FromLong(mx.dtype);
    items[2] = PyLong_FromLong(mx.device);
    items[3] = PyLong_FromUnsignedLongLong(mx.address % 16);
    items[4] = Py_NewRef(Py_None);  // (target's dims: in items[0])
    items[5] = PyLong_FromLong(mt.dtype);
    items[6] = PyLong_FromUnsignedLongLong(mt.address % 16);
    items[7] = Py_NewRef(grad ? Py_True : Py_False);
    for (int i = 3; i < 10; ++i) items[5 + i] = Py_NewRef(args[i]);  // ignore_index ... backend
    items[15] = PyLong_FromLong(mt.device);
    PyObject* k = PyTuple_New(16);
    for (int i = 0; i < 16; ++i) {
        if (!items[i] || !k) {
            for (int j = i; j < 16; ++j) Py_XDECREF(items[j]);
            Py_XDECREF(k);
            return NULL;
        }
        PyTuple_SET_ITEM(k, i, items[i]);
    }
    return k;
}

// loss_key(logits, target, class_weight, ignore_index, reduction, smoothing, softcap, z_loss, want_z,
//          backend[, cuda_only=True]) -> the key of a cross-entropy call (fastpath.loss_key), or None:
// (logits.shape, logits.dtype, logits.get_device(), logits' address mod 16, target.shape, target.dtype,
//  target's address mod 16, whether the logits need a gradient, ignore_index, reduction, smoothing, softcap,
//  z_loss, want_z, backend, target.get_device()); None too while another device than the logits' is current.
static PyObject* loss_key(PyObject* self, PyObject* const* args, Py_ssize_t n) {
    if (!configured()) return NULL;
    if (n != 10 && n != 11) {
        PyErr_SetString(PyExc_TypeError, "loss_key: 10 arguments (and cuda_only)");
        return NULL;
    }
    PyObject *x = args[0], *tg = args[1];
    int cuda_only = n == 11 ? PyObject_IsTrue(args[10]) : 1;
    if (cuda_only < 0) return NULL;
    if (Py_TYPE(x) != (PyTypeObject*)g_tensor || Py_TYPE(tg) != (PyTypeObject*)g_tensor || args[2] != Py_None)
        Py_RETURN_NONE;
    if (!PyLong_CheckExact(args[3]) || !PyUnicode_CheckExact(args[4]) || !PyUnicode_CheckExact(args[9]))
        Py_RETURN_NONE;
    if (!is_number(args[5]) || !is_number(args[7]) || !PyBool_Check(args[8])) Py_RETURN_NONE;
    if (args[6] != Py_None && !is_number(args[6])) Py_RETURN_NONE;
    int t;
    if (ft) return packed_loss_key(args, cuda_only);
    if (cuda_only) {
        if ((t = is_cuda(x)) <= 0 || (t = is_cuda(tg)) <= 0) return t < 0 ? NULL : Py_NewRef(Py_None);
    }
    PyObject* dtype = PyObject_GetAttr(x, s_dtype);
    if (!dtype) return NULL;
    t = PySequence_Contains(g_loss_dtypes, dtype);
    if (t <= 0) {
        Py_DECREF(dtype);
        return t < 0 ? NULL : Py_NewRef(Py_None);
    }
    PyObject* numel = call_method(x, s_numel);
    if (!numel) goto fail_dtype;
    t = PyObject_IsTrue(numel);
    Py_DECREF(numel);
    if (t <= 0) goto none_or_fail;
    PyObject* ts[2] = {x, tg};
    for (int i = 0; i < 2; ++i) {
        PyObject* c = call_method(ts[i], s_is_contiguous);
        if (!c) goto fail_dtype;
        t = c == Py_True;
        Py_DECREF(c);
        if (!t) goto none_or_fail;
    }
    if ((t = plain_state()) != 1) goto none_or_fail;
    unsigned long long px = address_of(x), pt;
    if (!px) {
        t = PyErr_Occurred() ? -1 : 0;
        goto none_or_fail;
    }
    if (!(pt = address_of(tg))) {
        t = PyErr_Occurred() ? -1 : 0;
        goto none_or_fail;
    }
    int grad = needs_grad(x);
    if (grad < 0) goto fail_dtype;
    PyObject* k = PyTuple_New(16);
    if (!k) goto fail_dtype;
    PyObject* items[16];
    items[0] = PyObject_GetAttr(x, s_shape);
    items[1] = dtype;  // (the reference taken above)
    items[2] = call_method(x, s_get_device);
    items[3] = PyLong_FromUnsignedLongLong(px % 16);
    items[4] = PyObject_GetAttr(tg, s_shape);
    items[5] = PyObject_GetAttr(tg, s_dtype);
    items[6] = PyLong_FromUnsignedLongLong(pt % 16);
    items[7] = Py_NewRef(grad ? Py_True : Py_False);
    for (int i = 3; i < 10; ++i) items[5 + i] = Py_NewRef(args[i]);  // ignore_index ... backend
    items[15] = call_method(tg, s_get_device);
    int bad = 0;
    for (int i = 0; i < 16; ++i) {
        if (!items[i]) bad = 1;
        PyTuple_SET_ITEM(k, i, items[i] ? items[i] : Py_NewRef(Py_None));
    }
    if (bad) {
        Py_DECREF(k);
        return NULL;
    }
    long dev = cuda_only ? PyLong_AsLong(items[2]) : -1;
    if (dev == -1 && PyErr_Occurred()) {
        Py_DECREF(k);
        return NULL;
    }
    if (cuda_only && (t = device_current(dev)) != 1) {  // (a replay launches on the current context)
        Py_DECREF(k);
        return t < 0 ? NULL : Py_NewRef(Py_None);
    }
    return k;
none_or_fail:
    Py_DECREF(dtype);
    return t < 0 ? NULL : Py_NewRef(Py_None);
fail_dtype:
    Py_DECREF(dtype);
    return NULL;
}

// The launches of steps ((desc address, (base index, byte offset, ...)), ...; one pair per address slot of
// that Desc: the address is base[index] + offset, or 0 for index -1) on the stream: 0 with *r the first
// failed launch's CUresult (the ones after it are not made) or 0; -1 with a Python error.
static int run_steps(unsigned long long stream, PyObject* steps, const unsigned long long* base, Py_ssize_t nb,
                     CUresult* r) {
    *r = 0;
    for (Py_ssize_t s = 0; s < PyTuple_GET_SIZE(steps); ++s) {
        PyObject* step = PyTuple_GET_ITEM(steps, s);
        if (!PyTuple_Check(step) || PyTuple_GET_SIZE(step) != 2 || !PyTuple_Check(PyTuple_GET_ITEM(step, 1))) {
            PyErr_SetString(PyExc_TypeError, "launch_steps: a step is (desc, (index, offset, ...))");
            return -1;
        }
        unsigned long long desc = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(step, 0));
        if (desc == (unsigned long long)-1 && PyErr_Occurred()) return -1;
        PyObject* slots = PyTuple_GET_ITEM(step, 1);
        Py_ssize_t ns = PyTuple_GET_SIZE(slots) / 2;
        if (ns > MAX_ADDRESSES || PyTuple_GET_SIZE(slots) % 2) {
            PyErr_SetString(PyExc_ValueError, "launch_steps: (index, offset) pairs, at most MAX_ADDRESSES");
            return -1;
        }
        unsigned long long addr[MAX_ADDRESSES];
        for (Py_ssize_t i = 0; i < ns; ++i) {
            long b = PyLong_AsLong(PyTuple_GET_ITEM(slots, 2 * i));
            long long off = PyLong_AsLongLong(PyTuple_GET_ITEM(slots, 2 * i + 1));
            if (PyErr_Occurred()) return -1;
            if (b < -1 || b >= nb) {
                PyErr_SetString(PyExc_IndexError, "launch_steps: a slot's base index is out of range");
                return -1;
            }
            addr[i] = b < 0 ? 0 : base[b] + (unsigned long long)off;
        }
        if (launch_desc((const Desc*)(uintptr_t)desc, stream, addr, (size_t)ns, r) < 0) return -1;
        if (*r != 0) return 0;
    }
    return 0;
}

#define MAX_BASES 16

// launch_steps(stream, steps, bases) -> 0, or the first failed launch's CUresult (run_steps' steps; bases:
// a tuple of addresses)
static PyObject* launch_steps(PyObject* self, PyObject* const* args, Py_ssize_t n) {
    if (n != 3 || !PyTuple_Check(args[1]) || !PyTuple_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "launch_steps(stream, steps: tuple, bases: tuple)");
        return NULL;
    }
    unsigned long long stream = PyLong_AsUnsignedLongLong(args[0]);
    if (stream == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    PyObject* bases = args[2];
    Py_ssize_t nb = PyTuple_GET_SIZE(bases);
    unsigned long long base[MAX_BASES];
    if (nb > MAX_BASES) {
        PyErr_SetString(PyExc_ValueError, "launch_steps: at most 16 bases");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nb; ++i) {
        base[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(bases, i));
        if (base[i] == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    }
    CUresult r;
    if (run_steps(stream, args[1], base, nb, &r) < 0) return NULL;
    return PyLong_FromLong(r);
}

// t's address (0 with an error set, or for no storage)
static unsigned long long tensor_address(PyObject* t) {
    FtMeta m;
    if (ft && Py_TYPE(t) == (PyTypeObject*)g_tensor) return ft->meta(t, &m) ? m.address : 0;
    return address_of(t);
}

// torch.empty_like(proto), its address in *addr: a new reference, NULL with an error
static PyObject* alloc_like(PyObject* proto, unsigned long long* addr) {
    if (ft && Py_TYPE(proto) == (PyTypeObject*)g_tensor) return ft->empty_like(proto, -1, addr);
    PyObject* y = PyObject_Vectorcall(g_empty_like, &proto, 1, NULL);
    if (y && !(*addr = address_of(y)) && PyErr_Occurred()) Py_CLEAR(y);
    return y;
}

// launch_new(steps, device, tensors, protos, derived) -> the new tensors (a tuple), or None where a launch
// failed (nothing is launched after it): the cross-entropy replay's calls (fastpath.py) in one. Allocates
// torch.empty_like(p) for each p in protos, then launches steps (run_steps') on device's current stream with
// the bases: the tensors' addresses, the new tensors', then base[i] + offset for each (i, offset) in derived.
static PyObject* launch_new(PyObject* self, PyObject* const* args, Py_ssize_t n) {
    if (!configured()) return NULL;
    if (n != 5 || !PyTuple_Check(args[0]) || !PyTuple_Check(args[2]) || !PyTuple_Check(args[3]) ||
        !PyTuple_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "launch_new(steps, device, tensors, protos, derived: tuples)");
        return NULL;
    }
    PyObject *tensors = args[2], *protos = args[3], *derived = args[4];
    Py_ssize_t nt = PyTuple_GET_SIZE(tensors), np = PyTuple_GET_SIZE(protos), nd = PyTuple_GET_SIZE(derived);
    if (nt + np + nd > MAX_BASES) {
        PyErr_SetString(PyExc_ValueError, "launch_new: at most 16 bases");
        return NULL;
    }
    unsigned long long base[MAX_BASES];
    for (Py_ssize_t i = 0; i < nt; ++i)
        if (!(base[i] = tensor_address(PyTuple_GET_ITEM(tensors, i))))
            return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    PyObject* out = PyTuple_New(np);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < np; ++i) {
        PyObject* y = alloc_like(PyTuple_GET_ITEM(protos, i), &base[nt + i]);
        if (!y) goto fail;
        PyTuple_SET_ITEM(out, i, y);
    }
    for (Py_ssize_t i = 0; i < nd; ++i) {
        PyObject* pair = PyTuple_GET_ITEM(derived, i);
        long b = PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2 ? PyLong_AsLong(PyTuple_GET_ITEM(pair, 0)) : -2;
        long long off = b >= -1 ? PyLong_AsLongLong(PyTuple_GET_ITEM(pair, 1)) : 0;
        if (PyErr_Occurred()) goto fail;
        if (b < 0 || b >= nt + np + i) {
            PyErr_SetString(PyExc_IndexError, "launch_new: a derived base is (an earlier base's index, offset)");
            goto fail;
        }
        base[nt + np + i] = base[b] + (unsigned long long)off;
    }
    PyObject* st = PyObject_Vectorcall(g_get_stream, &args[1], 1, NULL);
    if (!st) goto fail;
    unsigned long long stream = PyLong_AsUnsignedLongLong(st);
    Py_DECREF(st);
    if (stream == (unsigned long long)-1 && PyErr_Occurred()) goto fail;
    CUresult r;
    if (run_steps(stream, args[0], base, nt + np + nd, &r) < 0) goto fail;
    if (r == 0) return out;
    Py_DECREF(out);
    Py_RETURN_NONE;
fail:
    Py_DECREF(out);
    return NULL;
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
    {"configure", (PyCFunction)(void (*)(void))configure, METH_FASTCALL, "the probes and the cache (fastpath.py)"},
    {"configure_torch", configure_torch, METH_O, "fastlaunch_torch's table (a capsule), or None"},
    {"tensor_key", tensor_key, METH_O, "what a replay keys a tensor by"},
    {"softmax_key", (PyCFunction)(void (*)(void))softmax_key, METH_FASTCALL, "a softmax-family call's key, or None"},
    {"softmax_fast", (PyCFunction)(void (*)(void))softmax_fast, METH_FASTCALL,
     "a softmax-family call seen before, replayed; None: the full path runs"},
    {"loss_key", (PyCFunction)(void (*)(void))loss_key, METH_FASTCALL, "a cross-entropy call's key, or None"},
    {"loss_cpu", (PyCFunction)(void (*)(void))loss_cpu, METH_FASTCALL,
     "loss.py's CPU direct path for its common calls, or None"},
    {"configure_cpu", (PyCFunction)(void (*)(void))configure_cpu, METH_FASTCALL,
     "torch's CPU kernels and the plans for the CPU's direct path (fastpath.py)"},
    {"launch_steps", (PyCFunction)(void (*)(void))launch_steps, METH_FASTCALL,
     "launch_steps(stream, steps, bases) -> 0 or the first failed launch's CUresult"},
    {"launch_new", (PyCFunction)(void (*)(void))launch_new, METH_FASTCALL,
     "launch_new(steps, device, tensors, protos, derived) -> the new tensors, or None"},
    {"desc_size", desc_size, METH_NOARGS, "sizeof(Desc), for launch.py's check of its layout"},
    {"limits", limits, METH_NOARGS, "(MAX_PARAMS, MAX_BYTES, MAX_ADDRESSES, MAX_FILLS)"},
    {"driver_layout", driver_layout, METH_NOARGS, "sizes and offsets of the driver structures used here"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "fastlaunch", NULL, -1, methods};

PyMODINIT_FUNC PyInit_fastlaunch(void) { return PyModule_Create(&module); }
