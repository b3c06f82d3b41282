// fastlaunch's torch calls in C++: what fastlaunch.c otherwise asks of torch through Python (a tensor's shape,
// strides, dtype, device, address; an allocation; torch's CPU softmax kernels), made through ATen directly.
// From Python each of those is an argument parse and a new object: about 2 us of a replayed call's host
// time on the H200's host, as much as torch's whole eager softmax leaves for everything else.
// Built on first use with the C++ compiler against the running torch's headers (launch.py: cached per torch
// build); fastlaunch.c takes the table below from a capsule and keeps its Python calls where it cannot be
// built. Every function is called with the GIL held and lets no C++ exception out.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <ATen/EmptyTensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/_log_softmax.h>
#include <ATen/ops/_log_softmax_cpu_dispatch.h>
#include <ATen/ops/_softmax.h>
#include <ATen/ops/_softmax_backward_data.h>
#include <ATen/ops/_softmax_backward_data_cpu_dispatch.h>
#include <ATen/ops/_softmax_cpu_dispatch.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/nll_loss_nd.h>
#include <ATen/record_function.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>

#include <cmath>

#include "fastlaunch_torch.h"

namespace {

// 1 with *m filled for a strided CPU or CUDA tensor with storage of at most FT_MAX_DIMS dims (its Python type
// checked by the caller); 0 for anything else, a torch.func wrapper or a meta tensor included.
int meta(PyObject* obj, FtMeta* m) {
    try {
        const at::Tensor& t = THPVariable_Unpack(obj);
        if (!t.defined() || t.layout() != at::kStrided || t.dim() > FT_MAX_DIMS) return 0;
        if (t.is_neg() || t.is_conj()) return 0;  // (a lazy negation or conjugate: its memory is not its value)
        const auto dev = t.device();
        if (!dev.is_cpu() && !dev.is_cuda()) return 0;
        if (!t.has_storage()) return 0;  // (wrappers of torch.func and of subclasses keep none)
        m->ndim = static_cast<int>(t.dim());
        m->dtype = static_cast<int>(t.scalar_type());
        m->cuda = dev.is_cuda();
        m->device = dev.is_cuda() ? dev.index() : -1;
        m->requires_grad = t.requires_grad();
        m->contiguous = t.is_contiguous();
        m->numel = t.numel();
        // (const: data_ptr() would copy a copy-on-write tensor's storage)
        m->address = reinterpret_cast<unsigned long long>(t.const_data_ptr());
        for (int i = 0; i < m->ndim; ++i) {
            m->sizes[i] = t.size(i);
            m->strides[i] = t.stride(i);
        }
        return 1;
    } catch (...) {
        return 0;
    }
}

// The GIL released for a CPU kernel's run, as torch's own bindings do (other threads go on meanwhile)
struct NoGil {
    PyThreadState* state = PyEval_SaveThread();
    ~NoGil() { PyEval_RestoreThread(state); }
};

// a torch.dtype's c10::ScalarType number, -1 for any other object
int dtype_code(PyObject* obj) { return THPDtype_Check(obj) ? static_cast<int>(((THPDtype*)obj)->scalar_type) : -1; }

// torch.empty_like(t) (dtype < 0) or torch.empty_like(t, dtype=dtype), its address in *address: a new
// reference, NULL with torch's error (its Python type: an out-of-memory error stays one)
PyObject* empty_like(PyObject* obj, int dtype, unsigned long long* address) {
    HANDLE_TH_ERRORS
    const at::Tensor& t = THPVariable_Unpack(obj);
    const auto type = dtype < 0 ? t.scalar_type() : at::ScalarType(dtype);
    at::Tensor y;
    c10::Allocator* allocator = t.has_storage() ? t.storage().allocator() : nullptr;
    if (allocator && t.layout() == at::kStrided && t.is_non_overlapping_and_dense()) {
        // what empty_like makes of such a tensor (its strides, on its device, from the allocator its
        // storage came from: torch's current one, a pluggable one included), without the dispatcher's
        // layers: half its cost
        const c10::DeviceGuard guard(t.device());
        const auto key = c10::computeDispatchKey(std::nullopt, at::kStrided, t.device());
        y = at::detail::empty_strided_generic(t.sizes(), t.strides(), allocator, c10::DispatchKeySet(key), type);
    } else {
        y = at::empty_like(t, t.options().dtype(type));
    }
    *address = reinterpret_cast<unsigned long long>(y.const_data_ptr());
    return THPVariable_Wrap(std::move(y));
    END_HANDLE_TH_ERRORS
}

// torch._softmax(a, dim, False), torch._log_softmax(a, dim, False) (of a 16-bit a: computed in fp32, rounded
// once, as backends/torch.py's native_softmax) or torch._softmax_backward_data(a: dy, b: y, dim, dtype) on
// CPU tensors, the GIL released: through the whole dispatcher where autograd records or a profiler listens,
// else the CPU kernel itself (at::cpu::, what the dispatcher reaches for a plain CPU tensor). The output's
// address in *address; a new reference, NULL with torch's error.
PyObject* cpu_op(int op, PyObject* a, PyObject* b, long dim, int dtype, unsigned long long* address) {
    HANDLE_TH_ERRORS
    const at::Tensor& x = THPVariable_Unpack(a);
    const at::Tensor* y_in = b ? &THPVariable_Unpack(b) : nullptr;
    at::Tensor y;
    {
        NoGil released;
        // direct: nothing for autograd to record and no profiler (RecordFunction callback) to see it, so the
        // CPU kernel itself, as the dispatcher would reach it for a plain CPU tensor
        const bool graph = at::GradMode::is_enabled() && (x.requires_grad() || (y_in && y_in->requires_grad()));
        const bool direct = !graph && !at::hasCallbacks();
        if (op == FT_SOFTMAX)
            y = direct ? at::cpu::_softmax(x, dim, false) : at::_softmax(x, dim, false);
        else if (op == FT_LOG_SOFTMAX && (x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16))
            y = at::_log_softmax(x.to(at::kFloat), dim, false).to(x.scalar_type());  // (fp32 rows, rounded once)
        else if (op == FT_LOG_SOFTMAX)
            y = direct ? at::cpu::_log_softmax(x, dim, false) : at::_log_softmax(x, dim, false);
        else if (direct)
            y = at::cpu::_softmax_backward_data(x, *y_in, dim, at::ScalarType(dtype));
        else
            y = at::_softmax_backward_data(x, *y_in, dim, at::ScalarType(dtype));
    }
    *address = reinterpret_cast<unsigned long long>(y.const_data_ptr());
    return THPVariable_Wrap(std::move(y));
    END_HANDLE_TH_ERRORS
}

// backends/torch.py's native cross-entropy of CPU logits (..., V) (contiguous) and integer targets (...),
// no class weights, one chunk: torch's loss on fp32 rows (fp64 for fp64 logits), in the logits' dtype;
// graph 1 (logits needing a gradient, no smoothing): torch's log_softmax and nll_loss, its autograd graph
// kept. A new reference; NULL with an error, or with none where the Python path must run (a target out of
// range, whose error is the library's; a row whose log_softmax starts with NaN under graph).
PyObject* cpu_loss(PyObject* logits, PyObject* target, long ignore_index, int reduction, double smoothing,
                   int graph) {
    HANDLE_TH_ERRORS
    const at::Tensor& x = THPVariable_Unpack(logits);
    const at::Tensor& t = THPVariable_Unpack(target);
    at::Tensor loss;
    try {
        NoGil released;
        const auto wide = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
        // (each reshape or to() is a dispatch: made only where it changes something)
        const at::Tensor xs = x.dim() == 2 ? x : x.reshape({-1, x.size(-1)});
        const at::Tensor rows = xs.scalar_type() == wide ? xs : xs.to(wide);
        at::Tensor ts = t.dim() == 1 ? t : t.reshape({-1});
        if (ts.scalar_type() != at::kLong) ts = ts.to(at::kLong);
        if (graph) {
            at::Tensor ls = at::_log_softmax(rows, 1, false);
            const int64_t m = ls.size(0), v = ls.size(1);
            for (int64_t i = 0; i < m; ++i) {  // (there torch's gradient is not the library's)
                const bool nan = wide == at::kDouble ? std::isnan(ls.const_data_ptr<double>()[i * v])
                                                     : std::isnan(ls.const_data_ptr<float>()[i * v]);
                if (nan) return nullptr;
            }
            loss = at::nll_loss_nd(ls, ts, std::nullopt, reduction, ignore_index);
        } else {
            loss = at::cross_entropy_loss(rows, ts, std::nullopt, reduction, ignore_index, smoothing);
        }
        if (loss.scalar_type() != x.scalar_type()) loss = loss.to(x.scalar_type());
        if (reduction == 0) loss = loss.reshape(t.sizes());
    } catch (const c10::IndexError&) {
        return nullptr;  // (the GIL held again: NoGil's destructor ran first)
    }
    return THPVariable_Wrap(std::move(loss));
    END_HANDLE_TH_ERRORS
}

// What torch._C._are_functorch_transforms_active(), _len_torch_dispatch_stack() and _get_tracing_state() say,
// in one call without their Python bindings: 1 when none is active on this thread
int eager() {
    const auto included = c10::impl::tls_local_dispatch_key_set().included_;
    if (included.has(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) ||
        included.has(c10::DispatchKey::FuncTorchDynamicLayerBackMode))
        return 0;
    return c10::impl::TorchDispatchModeTLS::stack_len() == 0 && !torch::jit::tracer::isTracing();
}

int grad_enabled() { return at::GradMode::is_enabled(); }

const FtCalls calls = {FT_ABI, sizeof(FtMeta), meta, dtype_code, empty_like, cpu_op, cpu_loss, eager, grad_enabled};

PyObject* table(PyObject*, PyObject*) { return PyCapsule_New(const_cast<FtCalls*>(&calls), FT_CAPSULE, nullptr); }

PyMethodDef methods[] = {
    {"table", table, METH_NOARGS, "the capsule fastlaunch.c takes (fastlaunch_torch.h's FtCalls)"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "fastlaunch_torch", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_fastlaunch_torch(void) { return PyModule_Create(&module); }
