// The CPU's direct path in C (included by fastlaunch.c, whose probes it shares): api.py's _cpu and
// _cpu_backward for the common calls, torch's own kernel and the library's conventions, without the Python
// calls around them. At 1x4096 torch's softmax is a few us on a CPU, and the checks and dispatch in Python
// cost as much again (bench/results/cpu_torch.json). Taken here: backend 'auto', a contiguous torch.Tensor
// on the CPU with elements, no other output dtype, an eager call (eager_state: api.py's _cpu_ok's checks;
// autocast and heuristics.force leave the CPU's calls alone there too), and
//   softmax of fp32, fp64, fp16, bf16; log_softmax of fp32, and of fp16 and bf16 of one chunk in fp32
//   through fastlaunch_torch (fp64: another formula, see backends/torch.py);
//   under autograd, fp32 and bf16 rows in memory (the row kernels' graph, through fastlaunch_torch), else
//   fp32 and fp64 softmax and fp32 log_softmax (torch's graph, as native_softmax_graph);
//   softmax_backward with dy and y of one dtype and no autograd; log_softmax_backward the same, through
//   fastlaunch_torch only (its row kernels, or torch's kernel where no row of y starts below -100).
// Anything else returns None and the Python path runs, as does a call whose output has a row starting with
// NaN (a fully masked row, or one holding NaN or +inf): it is computed again there, and fixed.

enum { F32, F64, F16, BF16, N_FLOATS };
static PyObject* g_floats[N_FLOATS];  // torch.float32, float64, float16, bfloat16
static PyObject *g_softmax, *g_log_softmax, *g_softmax_bwd, *g_plan_native, *g_plan_graph;  // NULL: path off
static PyObject *g_plan_ce, *g_plan_ce_graph, *g_targets;  // cross-entropy's plans; its target dtypes (a tuple)
static PyObject *g_native, *s_chunk;  // backends/torch.py, and its CHUNK's name (read per call: tests change it)
static PyObject* g_zero;                // 0 (z_loss's only value here)
static PyObject *g_dispatch, *s_is_cpu, *s_devices, *s_cpu;

// configure_cpu(torch._softmax, torch._log_softmax, torch._softmax_backward_data, NATIVE plan, NATIVE_GRAPH
//               plan, (float32, float64, float16, bfloat16), the dispatch module (its DEVICES name 'cpu'),
//               NATIVE_CE plan, NATIVE_CE_GRAPH plan, the target dtypes, backends/torch.py (its CHUNK))
static PyObject* configure_cpu(PyObject* self, PyObject* const* args, Py_ssize_t n) {
    if (n != 11 || !PyTuple_Check(args[5]) || PyTuple_GET_SIZE(args[5]) != N_FLOATS || !PyTuple_Check(args[9])) {
        PyErr_SetString(PyExc_TypeError, "configure_cpu(softmax, log_softmax, softmax_bwd, native, graph, floats, "
                                         "dispatch, ce, ce_graph, targets, native)");
        return NULL;
    }
    if (!s_chunk && !(s_chunk = PyUnicode_InternFromString("CHUNK"))) return NULL;
    Py_XSETREF(g_native, Py_NewRef(args[10]));
    if (!g_zero && !(g_zero = PyLong_FromLong(0))) return NULL;
    Py_XSETREF(g_plan_ce, Py_NewRef(args[7]));
    Py_XSETREF(g_plan_ce_graph, Py_NewRef(args[8]));
    Py_XSETREF(g_targets, Py_NewRef(args[9]));
    if (!s_is_cpu) {  // (all three set together, or none)
        PyObject* is_cpu = PyUnicode_InternFromString("is_cpu");
        PyObject* devices = PyUnicode_InternFromString("DEVICES");
        PyObject* cpu = PyUnicode_InternFromString("cpu");
        if (!is_cpu || !devices || !cpu) {
            Py_XDECREF(is_cpu);
            Py_XDECREF(devices);
            Py_XDECREF(cpu);
            return NULL;
        }
        s_devices = devices, s_cpu = cpu, s_is_cpu = is_cpu;
    }
    PyObject** slots[] = {&g_softmax, &g_log_softmax, &g_softmax_bwd, &g_plan_native, &g_plan_graph};
    for (int i = 0; i < 5; ++i) Py_XSETREF(*slots[i], Py_NewRef(args[i]));
    Py_XSETREF(g_dispatch, Py_NewRef(args[6]));
    for (int i = 0; i < N_FLOATS; ++i) Py_XSETREF(g_floats[i], Py_NewRef(PyTuple_GET_ITEM(args[5], i)));
    Py_RETURN_NONE;
}

// t.dtype's index in g_floats, -1 for another dtype, -2 with an error
static int float_kind(PyObject* t) {
    PyObject* dt = PyObject_GetAttr(t, s_dtype);
    if (!dt) return -2;
    int k = -1;
    for (int i = 0; i < N_FLOATS; ++i)
        if (dt == g_floats[i]) k = i;
    Py_DECREF(dt);
    return k;
}

// A CPU tensor as cpu_fast takes it: its dims (at most FT_MAX_DIMS), kind (index in g_floats), address and
// whether it requires grad (-1: not probed; needs_grad asks)
typedef struct {
    int ndim, kind, requires_grad;
    long long sizes[FT_MAX_DIMS];
    unsigned long long address;
} CpuTensor;

// 1 when t is a contiguous CPU tensor (exactly torch.Tensor) with elements and storage, of at most
// FT_MAX_DIMS dims, *c filled (kind -1 for a dtype not in g_floats); 0: not one; -1: error. ``known``: t's
// FtMeta where the caller has read it through fastlaunch_torch already (then loaded), else NULL.
static int plain_cpu(PyObject* t, CpuTensor* c, const FtMeta* known) {
    if (Py_TYPE(t) != (PyTypeObject*)g_tensor) return 0;
    const FtCalls* calls = ft;
    if (calls) {
        FtMeta read;
        const FtMeta* m = known ? known : calls->meta(t, &read) ? &read : NULL;
        if (!m || m->cuda || !m->contiguous || !m->numel || !m->address) return 0;
        c->ndim = m->ndim, c->address = m->address, c->requires_grad = m->requires_grad, c->kind = -1;
        memcpy(c->sizes, m->sizes, sizeof m->sizes);
        for (int i = 0; i < N_FLOATS; ++i)
            if (calls->dtype_code(g_floats[i]) == m->dtype) c->kind = i;
        return 1;
    }
    int ok = attr_is(t, s_is_cpu, Py_True);
    if (ok <= 0) return ok;
    PyObject* cont = call_method(t, s_is_contiguous);
    if (!cont) {  // (a sparse layout has none: the Python path says what it says)
        PyErr_Clear();
        return 0;
    }
    ok = cont == Py_True;
    Py_DECREF(cont);
    if (!ok) return 0;
    PyObject* shape = PyObject_GetAttr(t, s_shape);  // a torch.Size: a tuple of ints
    if (!shape) return -1;
    Py_ssize_t nd = PyTuple_Check(shape) ? PyTuple_GET_SIZE(shape) : FT_MAX_DIMS + 1;
    ok = nd <= FT_MAX_DIMS;
    for (Py_ssize_t i = 0; ok && i < nd; ++i) {
        c->sizes[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
        ok = c->sizes[i] > 0;  // (no elements, or an error: not taken)
    }
    Py_DECREF(shape);
    if (!ok) return PyErr_Occurred() ? -1 : 0;
    c->ndim = (int)nd;
    if ((c->kind = float_kind(t)) < -1) return -1;
    c->requires_grad = -1;
    c->address = address_of(t);  // (a storage resized to 0 bytes: the full path says so)
    return c->address ? 1 : PyErr_Occurred() ? -1 : 0;
}

// t's requires_grad (as probed, or asked) and torch.is_grad_enabled(): 1, 0, or -1 with an error
static int cpu_grad(PyObject* t, const CpuTensor* c) {
    if (c->requires_grad < 0) return needs_grad(t);
    return c->requires_grad ? grad_mode() : 0;
}

// Whether a row (along dim) of the contiguous tensor at addr starts with NaN, by its bits
static int any_nan_first(unsigned long long addr, int kind, long long outer, long long n, long long inner) {
    for (long long o = 0; o < outer; ++o) {
        for (long long i = 0; i < inner; ++i) {
            long long at = o * n * inner + i;
            if (kind == F32) {
                uint32_t u;
                memcpy(&u, (const char*)(uintptr_t)addr + 4 * at, 4);
                if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 1;
            } else if (kind == F64) {
                uint64_t u;
                memcpy(&u, (const char*)(uintptr_t)addr + 8 * at, 8);
                if ((u & 0x7FFFFFFFFFFFFFFFull) > 0x7FF0000000000000ull) return 1;
            } else {
                uint16_t u;
                memcpy(&u, (const char*)(uintptr_t)addr + 2 * at, 2);
                if ((u & 0x7FFF) > (kind == F16 ? 0x7C00 : 0x7F80)) return 1;
            }
        }
    }
    return 0;
}

static PyObject* recorded(PyObject* out, PyObject* plan) {
    if (record_plan(plan) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

// torch's kernel or fastlaunch_torch's: op (FT_SOFTMAX, FT_LOG_SOFTMAX, FT_SOFTMAX_BACKWARD and
// FT_LOG_SOFTMAX_BACKWARD: a is dy, b is y) along the normalised dim, in the dtype of g_floats[kind]
// (autograd records where it may); its address in *address. A new reference, or NULL with an error, or with
// none where the Python path must run (log_softmax's backward of a row that may be fully masked).
static PyObject* cpu_kernel(int op, PyObject* a, PyObject* b, long dim, int kind, unsigned long long* address) {
    PyObject* out;
    const FtCalls* calls = ft;
    *address = 0;
    if (calls) {
        out = calls->cpu_op(op, a, b, dim, calls->dtype_code(g_floats[kind]), address);
    } else if (op == FT_LOG_SOFTMAX_BACKWARD) {
        return NULL;
    } else {
        PyObject* dim_n = PyLong_FromLong(dim);  // (normalised, as the Python path passes it: the graph saves it)
        if (!dim_n) return NULL;
        if (op == FT_SOFTMAX_BACKWARD) {
            PyObject* args[4] = {a, b, dim_n, g_floats[kind]};
            out = PyObject_Vectorcall(g_softmax_bwd, args, 4, NULL);
        } else {
            PyObject* args[3] = {a, dim_n, Py_False};
            out = PyObject_Vectorcall(op == FT_LOG_SOFTMAX ? g_log_softmax : g_softmax, args, 3, NULL);
        }
        Py_DECREF(dim_n);
    }
    if (!out) return NULL;
    if (!calls) *address = address_of(out);
    if (!*address) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "fastlaunch: torch's softmax gave no storage");
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

// backends/torch.py's CHUNK (read per call: tests change it); -1 with an error
static long long chunk_elements(void) {
    PyObject* chunk = module_attr(g_native, s_chunk);
    long long n = chunk ? PyLong_AsLongLong(chunk) : -1;
    Py_XDECREF(chunk);
    return n;
}

// softmax_fast's CPU branch: (x, dy or None, dim, dtype, log, backend) as softmax_fast's arguments
static PyObject* cpu_fast(PyObject* x, PyObject* d, PyObject* dim, PyObject* dtype, PyObject* log, PyObject* backend,
                          const FtMeta* x_meta) {
    if (!g_softmax || !PyUnicode_Check(backend) || PyUnicode_CompareWithASCIIString(backend, "auto") != 0 ||
        !PyLong_CheckExact(dim) || (log != Py_True && log != Py_False) || (d != Py_None && log == Py_True && !ft))
        Py_RETURN_NONE;
    // first: under a torch.func transform x is a wrapper (still exactly torch.Tensor) whose data_ptr raises
    int t = eager_state();
    if (t != 1) return t < 0 ? NULL : Py_NewRef(Py_None);
    CpuTensor cx, cd;
    if ((t = plain_cpu(x, &cx, x_meta)) <= 0) return t < 0 ? NULL : Py_NewRef(Py_None);
    if (cx.kind < 0 || (dtype != Py_None && dtype != g_floats[cx.kind])) Py_RETURN_NONE;
    long dm = PyLong_AsLong(dim);
    if (dm == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (dm < -cx.ndim || dm >= cx.ndim) Py_RETURN_NONE;  // (the full path raises its error)
    if (dm < 0) dm += cx.ndim;
    long long outer = 1, n = cx.sizes[dm], inner = 1;
    for (int i = 0; i < cx.ndim; ++i) {
        if (i < dm) outer *= cx.sizes[i];
        if (i > dm) inner *= cx.sizes[i];
    }
    PyObject* devices = module_attr(g_dispatch, s_devices);  // (a device without a path: the full path raises)
    t = devices ? PySequence_Contains(devices, s_cpu) : -1;
    Py_XDECREF(devices);
    int grad = t == 1 ? cpu_grad(x, &cx) : t;
    if (t != 1 || grad < 0) return t < 0 || grad < 0 ? NULL : Py_NewRef(Py_None);
    PyObject* out;
    unsigned long long p;
    if (d != Py_None) {  // softmax_backward(dy, y): x is y here; dy of y's shape and dtype, neither needing grad
        if ((t = plain_cpu(d, &cd, NULL)) == 1)
            t = cd.ndim == cx.ndim && !memcmp(cd.sizes, cx.sizes, cx.ndim * sizeof cx.sizes[0]) && cd.kind == cx.kind;
        if (t == 1) {
            int g = cpu_grad(d, &cd);
            t = g < 0 ? -1 : !g;
        }
        if (t != 1 || grad) return t < 0 ? NULL : Py_NewRef(Py_None);
        out = cpu_kernel(log == Py_True ? FT_LOG_SOFTMAX_BACKWARD : FT_SOFTMAX_BACKWARD, d, x, dm, cx.kind, &p);
        if (!out) return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    } else {
        // log: fp64 takes the reference's formula, 16-bit fp32 rows (through fastlaunch_torch, within one
        // chunk: past it the Python path's chunks keep the fp32 rows in cache); 16-bit autograd: the row
        // kernels' graph for bf16 rows in memory (fastlaunch_torch's), else the Function
        int low = cx.kind == F16 || cx.kind == BF16, rows_graph = cx.kind == BF16 && ft && inner == 1;
        if ((log == Py_True && (cx.kind == F64 || (low && !ft))) || (grad && low && !rows_graph)) Py_RETURN_NONE;
        if (log == Py_True && low) {
            long long chunk = chunk_elements();
            if (chunk < 0) return NULL;
            if (outer * n * inner > chunk) Py_RETURN_NONE;
        }
        out = cpu_kernel(log == Py_True ? FT_LOG_SOFTMAX : FT_SOFTMAX, x, NULL, dm, cx.kind, &p);
    }
    if (!out || !any_nan_first(p, cx.kind, outer, n, inner))
        return out ? recorded(out, d == Py_None && grad ? g_plan_graph : g_plan_native) : NULL;
    Py_DECREF(out);  // (a row starting with NaN: the Python path fixes it)
    Py_RETURN_NONE;
}

// loss_cpu(logits, target, class_weight, ignore_index, reduction, smoothing, softcap, z_loss, want_z, backend)
// -> the loss, or None (the Python path runs): loss.py's CPU direct path in C for its common calls, through
// fastlaunch_torch: backend 'auto', no class weights, softcap, z-loss or z output; contiguous CPU logits
// (..., V) of a float dtype in one chunk (backends/torch.py's CHUNK) and contiguous integer targets shaped
// (...); an eager call, no autocast; where the logits need a gradient, no smoothing (torch's graph). A
// target out of range, or a NaN row under autograd, is handed to the Python path, which says or does what
// it does.
static PyObject* loss_cpu(PyObject* self, PyObject* const* args, Py_ssize_t n) {
    if (n != 10) {
        PyErr_SetString(PyExc_TypeError, "loss_cpu: 10 arguments");
        return NULL;
    }
    PyObject *x = args[0], *tg = args[1];
    const FtCalls* calls = ft;  // (read once: the build's thread may set it while Python code runs below)
    if (!calls || !g_plan_ce || args[2] != Py_None || args[6] != Py_None || args[8] != Py_False) Py_RETURN_NONE;
    if (!PyUnicode_Check(args[9]) || PyUnicode_CompareWithASCIIString(args[9], "auto") != 0) Py_RETURN_NONE;
    if (!is_number(args[7]) || PyObject_RichCompareBool(args[7], g_zero, Py_EQ) != 1) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (!PyLong_CheckExact(args[3]) || !is_number(args[5]) || !PyUnicode_Check(args[4])) Py_RETURN_NONE;
    int reduction = -1;
    const char* names[] = {"none", "mean", "sum"};  // (torch's enum)
    for (int i = 0; i < 3; ++i)
        if (PyUnicode_CompareWithASCIIString(args[4], names[i]) == 0) reduction = i;
    int overflow;
    long ignore = PyLong_AsLongAndOverflow(args[3], &overflow);
    double eps = PyFloat_AsDouble(args[5]);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (reduction < 0 || overflow || !(eps >= 0.0 && eps <= 1.0)) Py_RETURN_NONE;
    if (Py_TYPE(x) != (PyTypeObject*)g_tensor || Py_TYPE(tg) != (PyTypeObject*)g_tensor) Py_RETURN_NONE;
    CpuTensor cx, ct;  // (first, through fastlaunch_torch: a torch.func wrapper or a CUDA tensor is not one)
    int t;
    if ((t = plain_cpu(x, &cx, NULL)) != 1 || (t = plain_cpu(tg, &ct, NULL)) != 1)
        return t < 0 ? NULL : Py_NewRef(Py_None);
    if ((t = eager_state()) != 1) return t < 0 ? NULL : Py_NewRef(Py_None);
    if ((t = call_truthy(g_autocast)) != 0) return t < 0 ? NULL : Py_NewRef(Py_None);
    long long numel = 1;
    for (int i = 0; i < cx.ndim; ++i) numel *= cx.sizes[i];
    long long chunk = chunk_elements();
    if (chunk < 0) return NULL;
    if (cx.kind < 0 || numel > chunk || ct.ndim != cx.ndim - 1) Py_RETURN_NONE;
    if (memcmp(ct.sizes, cx.sizes, ct.ndim * sizeof ct.sizes[0]) != 0) Py_RETURN_NONE;
    FtMeta mt;
    int target_ok = 0;
    if (!calls->meta(tg, &mt)) Py_RETURN_NONE;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(g_targets); ++i)
        target_ok |= calls->dtype_code(PyTuple_GET_ITEM(g_targets, i)) == mt.dtype;
    if (!target_ok) Py_RETURN_NONE;
    PyObject* devices = module_attr(g_dispatch, s_devices);  // (a device without a path: the full path raises)
    t = devices ? PySequence_Contains(devices, s_cpu) : -1;
    Py_XDECREF(devices);
    int grad = t == 1 ? cpu_grad(x, &cx) : t;
    if (t != 1 || grad < 0 || (grad && eps != 0.0)) return t < 0 || grad < 0 ? NULL : Py_NewRef(Py_None);
    PyObject* loss = calls->cpu_loss(x, tg, ignore, reduction, eps, grad);
    if (!loss) return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    return recorded(loss, grad ? g_plan_ce_graph : g_plan_ce);
}
