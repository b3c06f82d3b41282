// The CPU's direct path in C (included by fastlaunch.c, whose probes it shares): api.py's _cpu and
// _cpu_backward for the common calls, torch's own kernel and the library's conventions, without the Python
// calls around them. At 1x4096 torch's softmax is a few us on a CPU, and the checks and dispatch in Python
// cost as much again (bench/results/cpu_torch.json). Taken here: backend 'auto', a contiguous torch.Tensor
// on the CPU with elements, no other output dtype, an eager call (eager_state: api.py's _cpu_ok's checks;
// autocast and heuristics.force leave the CPU's calls alone there too), and
//   softmax of fp32, fp64, fp16, bf16; log_softmax of fp32 (the others: other formulas, see backends/torch.py);
//   under autograd, fp32 and fp64 softmax and fp32 log_softmax (torch's graph, as native_softmax_graph);
//   softmax_backward with dy and y of one dtype and no autograd.
// Anything else returns None and the Python path runs, as does a call whose output has a row starting with
// NaN (a fully masked row, or one holding NaN or +inf): it is computed again there, and fixed.

enum { F32, F64, F16, BF16, N_FLOATS };
static PyObject* g_floats[N_FLOATS];  // torch.float32, float64, float16, bfloat16
static PyObject *g_softmax, *g_log_softmax, *g_softmax_bwd, *g_plan_native, *g_plan_graph;  // NULL: path off
static PyObject *g_dispatch, *s_is_cpu, *s_devices, *s_cpu;

// configure_cpu(torch._softmax, torch._log_softmax, torch._softmax_backward_data, NATIVE plan, NATIVE_GRAPH
//               plan, (float32, float64, float16, bfloat16), the dispatch module (its DEVICES name 'cpu'))
static PyObject* configure_cpu(PyObject* self, PyObject* const* args, Py_ssize_t n) {
    if (n != 7 || !PyTuple_Check(args[5]) || PyTuple_GET_SIZE(args[5]) != N_FLOATS) {
        PyErr_SetString(PyExc_TypeError, "configure_cpu(softmax, log_softmax, softmax_bwd, native, graph, floats, "
                                         "dispatch)");
        return NULL;
    }
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

// x.dtype's index in g_floats, -1 for another dtype, -2 with an error
static int float_kind(PyObject* t) {
    PyObject* dt = PyObject_GetAttr(t, s_dtype);
    if (!dt) return -2;
    int k = -1;
    for (int i = 0; i < N_FLOATS; ++i)
        if (dt == g_floats[i]) k = i;
    Py_DECREF(dt);
    return k;
}

// 1 when t is a contiguous CPU tensor (exactly torch.Tensor) with elements and storage; its shape (a new
// reference), its sizes' product before dim (outer), at dim (n) and after it (inner) set, dim normalised.
// 0: not one; -1: error
static int plain_cpu(PyObject* t, PyObject* dim_obj, PyObject** shape_out, long* dim, long long* outer, long long* n,
                     long long* inner) {
    if (Py_TYPE(t) != (PyTypeObject*)g_tensor) return 0;
    int ok = attr_is(t, s_is_cpu, Py_True);
    if (ok <= 0) return ok;
    PyObject* c = call_method(t, s_is_contiguous);
    if (!c) {  // (a sparse layout has none: the Python path says what it says)
        PyErr_Clear();
        return 0;
    }
    ok = c == Py_True;
    Py_DECREF(c);
    if (!ok) return 0;
    PyObject* shape = PyObject_GetAttr(t, s_shape);  // a torch.Size: a tuple of ints
    if (!shape) return -1;
    if (!PyTuple_Check(shape)) {
        Py_DECREF(shape);
        return 0;
    }
    Py_ssize_t nd = PyTuple_GET_SIZE(shape);
    long d = PyLong_AsLong(dim_obj);
    if (d == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        Py_DECREF(shape);
        return 0;
    }
    if (nd == 0 || d < -nd || d >= nd) {  // (the full path raises its error)
        Py_DECREF(shape);
        return 0;
    }
    if (d < 0) d += nd;
    long long o = 1, in = 1, m = 0;
    for (Py_ssize_t i = 0; i < nd; ++i) {
        long long s = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
        if (s <= 0) {  // no elements (or an error): the full path
            Py_DECREF(shape);
            if (PyErr_Occurred()) return -1;
            return 0;
        }
        if (i < d) o *= s;
        if (i == d) m = s;
        if (i > d) in *= s;
    }
    unsigned long long a = address_of(t);  // (a storage resized to 0 bytes: the full path says so)
    if (!a) {
        Py_DECREF(shape);
        return PyErr_Occurred() ? -1 : 0;
    }
    *shape_out = shape, *dim = d, *outer = o, *n = m, *inner = in;
    return 1;
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
    PyObject* r = PyObject_Vectorcall(g_record, &plan, 1, NULL);
    if (!r) {
        Py_DECREF(out);
        return NULL;
    }
    Py_DECREF(r);
    return out;
}

// softmax_fast's CPU branch: (x, dy or None, dim, dtype, log, backend) as softmax_fast's arguments
static PyObject* cpu_fast(PyObject* x, PyObject* d, PyObject* dim, PyObject* dtype, PyObject* log, PyObject* backend) {
    if (!g_softmax || !PyUnicode_Check(backend) || PyUnicode_CompareWithASCIIString(backend, "auto") != 0 ||
        !PyLong_CheckExact(dim) || (log != Py_True && log != Py_False) || (d != Py_None && log == Py_True))
        Py_RETURN_NONE;
    // first: under a torch.func transform x is a wrapper (still exactly torch.Tensor) whose data_ptr raises
    int t = eager_state();
    if (t != 1) return t < 0 ? NULL : Py_NewRef(Py_None);
    long dm;
    long long outer, n, inner;
    PyObject *shape = NULL, *out = NULL, *dim_n = NULL;
    if ((t = plain_cpu(x, dim, &shape, &dm, &outer, &n, &inner)) <= 0) return t < 0 ? NULL : Py_NewRef(Py_None);
    PyObject* result = Py_None;  // (borrowed until the end: None hands the call to the Python path)
    int k = float_kind(x);
    if (k < 0 || (dtype != Py_None && dtype != g_floats[k])) {
        if (k < -1) result = NULL;
        goto done;
    }
    PyObject* devices = PyObject_GetAttr(g_dispatch, s_devices);  // (a device without a path: the full path raises)
    t = devices ? PySequence_Contains(devices, s_cpu) : -1;
    Py_XDECREF(devices);
    int grad = t == 1 ? needs_grad(x) : t;
    if (t != 1 || grad < 0) {
        if (t < 0 || grad < 0) result = NULL;
        goto done;
    }
    if (!(dim_n = PyLong_FromLong(dm))) {  // (normalised, as the Python path passes it: the graph saves it)
        result = NULL;
        goto done;
    }
    if (d != Py_None) {  // softmax_backward(dy, y): x is y here; dy of y's shape and dtype, neither needing grad
        if (grad) goto done;
        PyObject* d_shape = NULL;
        long d_dim;
        long long o2, n2, i2;
        if ((t = plain_cpu(d, dim, &d_shape, &d_dim, &o2, &n2, &i2)) == 1) {
            t = PyObject_RichCompareBool(shape, d_shape, Py_EQ);
            Py_DECREF(d_shape);
        }
        if (t == 1) {
            int kd = float_kind(d);
            t = kd < -1 ? -1 : kd == k;
        }
        if (t == 1) {
            int g = needs_grad(d);
            t = g < 0 ? -1 : !g;
        }
        if (t != 1) {
            if (t < 0) result = NULL;
            goto done;
        }
        PyObject* a[4] = {d, x, dim_n, g_floats[k]};
        out = PyObject_Vectorcall(g_softmax_bwd, a, 4, NULL);
    } else {
        if ((log == Py_True && k != F32) || (grad && (k == F16 || k == BF16)))
            goto done;  // log: fp64 takes the reference's formula, 16-bit fp32 rows; 16-bit autograd: the Function
        PyObject* a[3] = {x, dim_n, Py_False};
        out = PyObject_Vectorcall(log == Py_True ? g_log_softmax : g_softmax, a, 3, NULL);
    }
    if (!out) {
        result = NULL;
        goto done;
    }
    unsigned long long p = address_of(out);
    if (!p) {
        if (PyErr_Occurred()) result = NULL;
    } else if (!any_nan_first(p, k, outer, n, inner)) {  // (a row starting with NaN: the Python path fixes it)
        result = recorded(out, d == Py_None && grad ? g_plan_graph : g_plan_native);
        out = NULL;  // (recorded() took it)
    }
done:
    Py_DECREF(shape);
    Py_XDECREF(dim_n);
    Py_XDECREF(out);
    return result == Py_None ? Py_NewRef(Py_None) : result;
}
