// fastlaunch's torch calls in C++: what fastlaunch.c otherwise asks of torch through Python (a tensor's shape,
// strides, dtype, device, address; an allocation; torch's CPU softmax kernels), made through ATen directly;
// and the CPU row kernels (cpu_rows.h) with their autograd nodes, for fastlaunch.c and for Python.
// From Python each of those is an argument parse and a new object: about 2 us of a replayed call's host
// time on the H200's host, as much as torch's whole eager softmax leaves for everything else.
// Built on first use with the C++ compiler against the running torch's headers (launch.py: cached per torch
// build); fastlaunch.c takes the table below from a capsule and keeps its Python calls where it cannot be
// built. Every function is called with the GIL held and lets no C++ exception out.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/_log_softmax.h>
#include <ATen/ops/_log_softmax_backward_data.h>
#include <ATen/ops/_log_softmax_backward_data_cpu_dispatch.h>
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
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/generated/Functions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "cpu_rows.h"
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

// The GIL released for a CPU kernel's run, as torch's own bindings do (other threads go on meanwhile). The
// tensors torch's kernels read are held by value, taken before: a tensor whose only reference is its Python
// object's takes the GIL back each time a kernel copies its handle (TensorImpl::incref_pyobject, from torch
// 2.10), four times a call in torch's softmax backward. The row kernels copy none: theirs are held by
// reference (a copy, and its release, cost about 400 instructions a tensor).
struct NoGil {
    PyThreadState* state = PyEval_SaveThread();
    ~NoGil() { PyEval_RestoreThread(state); }
};

// a torch.dtype's c10::ScalarType number, -1 for any other object
int dtype_code(PyObject* obj) { return THPDtype_Check(obj) ? static_cast<int>(((THPDtype*)obj)->scalar_type) : -1; }

// torch.empty_like(t, dtype=type), made as empty_like makes it for a dense tensor (its strides, on its
// device, from the allocator its storage came from: torch's current one, a pluggable one included) without
// the dispatcher's layers: half its cost
at::Tensor new_like(const at::Tensor& t, at::ScalarType type) {
    c10::Allocator* allocator = t.has_storage() ? t.storage().allocator() : nullptr;
    if (!allocator || t.layout() != at::kStrided || !t.is_non_overlapping_and_dense())
        return at::empty_like(t, t.options().dtype(type));
    const c10::DeviceGuard guard(t.device());
    const auto key = c10::computeDispatchKey(std::nullopt, at::kStrided, t.device());
    return at::detail::empty_strided_generic(t.sizes(), t.strides(), allocator, c10::DispatchKeySet(key), type);
}

// torch.empty_like(t) (dtype < 0) or torch.empty_like(t, dtype=dtype), its address in *address: a new
// reference, NULL with torch's error (its Python type: an out-of-memory error stays one)
PyObject* empty_like(PyObject* obj, int dtype, unsigned long long* address) {
    HANDLE_TH_ERRORS
    const at::Tensor& t = THPVariable_Unpack(obj);
    at::Tensor y = new_like(t, dtype < 0 ? t.scalar_type() : at::ScalarType(dtype));
    *address = reinterpret_cast<unsigned long long>(y.const_data_ptr());
    return THPVariable_Wrap(std::move(y));
    END_HANDLE_TH_ERRORS
}

// ---- the row kernels (cpu_rows.h) on tensors ----------------------------------------------------------------

// What one torch.func transform, torch_dispatch mode or jit trace would have to see: 1 when none is active on
// this thread (torch._C._are_functorch_transforms_active(), _len_torch_dispatch_stack(), _get_tracing_state()
// in one call, without their Python bindings)
int eager() {
    const auto included = c10::impl::tls_local_dispatch_key_set().included_;
    if (included.has(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) ||
        included.has(c10::DispatchKey::FuncTorchDynamicLayerBackMode))
        return 0;
    return c10::impl::TorchDispatchModeTLS::stack_len() == 0 && !torch::jit::tracer::isTracing();
}

// Whether t is the row kernels': a plain contiguous CPU tensor of fp32 or bf16 with elements whose rows along
// dim lie in memory (every later dim of size 1), and nothing (a subclass, a mode, a transform) to see the op
bool rows_of(const at::Tensor& t, int64_t dim) {
    if (!t.defined() || t.layout() != at::kStrided || !t.device().is_cpu() || !t.has_storage()) return false;
    if (t.scalar_type() != at::kFloat && t.scalar_type() != at::kBFloat16) return false;
    if (t.is_neg() || t.is_conj() || t.numel() == 0 || !t.is_contiguous() || dim < 0 || dim >= t.dim()) return false;
    if (t.key_set().has(c10::DispatchKey::Python)) return false;
    for (int64_t d = dim + 1; d < t.dim(); ++d)
        if (t.size(d) != 1) return false;
    return true;
}

// rows per parallel task: about 32K elements, as torch's own kernels split (at::internal::GRAIN_SIZE)
int64_t grain(int64_t n) { return std::max<int64_t>(1, 32768 / n); }

template <class F>
void on_rows(const at::Tensor& t, F&& row) {  // row(pointer cast) for fp32 or bf16 t
    if (t.scalar_type() == at::kFloat)
        row(static_cast<float*>(nullptr));
    else
        row(static_cast<rows::bf16*>(nullptr));
}

// softmax (log_softmax) of x (rows_of(x, dim)) along dim, in x's dtype: a new tensor laid out as x
at::Tensor softmax_rows(const at::Tensor& x, int64_t dim, bool log) {
    RECORD_FUNCTION(log ? "fastsoftmax::log_softmax_rows" : "fastsoftmax::softmax_rows", std::vector<c10::IValue>({x}));
    at::Tensor y = new_like(x, x.scalar_type());
    const int64_t n = x.size(dim), m = x.numel() / n;
    on_rows(x, [&](auto* type) {
        using T = std::remove_pointer_t<decltype(type)>;
        const T* xp = static_cast<const T*>(x.const_data_ptr());
        T* yp = static_cast<T*>(y.mutable_data_ptr());
        at::parallel_for(0, m, grain(n), [&](int64_t b, int64_t e) {
            for (int64_t r = b; r < e; ++r) rows::softmax_row(xp + r * n, yp + r * n, n, log);
        });
    });
    return y;
}

// The backward row kernels' largest tensor (elements): there a call's fixed cost, which they save (about
// 0.3 us: no tensor copied across the GIL release), is still 2% of it; beyond, torch's kernels, as fast
// or faster (on fresh output pages ours were 1.13-1.16x: docs/performance.md's CPU section)
constexpr int64_t kBackwardRowsMax = int64_t(1) << 16;

// Whether dy and y are the backward row kernels': rows_of(y, dim), dy of y's shape and dtype, contiguous,
// and at most kBackwardRowsMax elements
bool backward_rows_of(const at::Tensor& dy, const at::Tensor& y, int64_t dim) {
    return rows_of(y, dim) && rows_of(dy, dim) && dy.scalar_type() == y.scalar_type() &&
           dy.sizes() == y.sizes() && y.numel() <= kBackwardRowsMax;
}

// softmax's (log_softmax's) backward of dy and y (backward_rows_of) along dim, in y's dtype: a new tensor
// laid out as y
at::Tensor softmax_backward_rows(const at::Tensor& dy, const at::Tensor& y, int64_t dim, bool log) {
    RECORD_FUNCTION(log ? "fastsoftmax::log_softmax_backward_rows" : "fastsoftmax::softmax_backward_rows",
                    std::vector<c10::IValue>({dy, y}));
    at::Tensor dx = new_like(y, y.scalar_type());
    const int64_t n = y.size(dim), m = y.numel() / n;
    on_rows(y, [&](auto* type) {
        using T = std::remove_pointer_t<decltype(type)>;
        const T* dyp = static_cast<const T*>(dy.const_data_ptr());
        const T* yp = static_cast<const T*>(y.const_data_ptr());
        T* dxp = static_cast<T*>(dx.mutable_data_ptr());
        at::parallel_for(0, m, grain(n), [&](int64_t b, int64_t e) {
            for (int64_t r = b; r < e; ++r) rows::softmax_backward_row(dyp + r * n, yp + r * n, dxp + r * n, n, log);
        });
    });
    return dx;
}

// A new autograd node of type N, held as this torch holds nodes: a std::shared_ptr with torch's iterative
// deleter (torch up to 2.1x), or a c10::intrusive_ptr (since)
template <class N>
auto new_node() {
    using Held = decltype(torch::autograd::Edge().function);
    if constexpr (std::is_same_v<Held, std::shared_ptr<torch::autograd::Node>>)
        return std::shared_ptr<N>(new N(), [](auto* n) { deleteNode(n); });  // (found by ADL: torch::autograd)
    else
        return c10::make_intrusive<N>();
}

// The backward of a bf16 softmax_rows_graph: the backward row kernels where nothing is recorded
// (fs.softmax_backward's and fs.log_softmax_backward's, so the first-order gradient is theirs; torch's kernel
// for a dy they do not take, as theirs too); the library's formula in fp32 where a double backward is asked
// for (create_graph: reference.softmax_backward_torch's, which autograd records), as the library's Function
// has it.
struct SoftmaxRowsBackward : torch::autograd::Node {
    torch::autograd::SavedVariable y_;
    int64_t dim = 0;
    bool log = false;

    std::string name() const override { return log ? "LogSoftmaxRowsBackward" : "SoftmaxRowsBackward"; }
    void release_variables() override { y_.reset_data(); }
    torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
        if (!grads[0].defined()) return {at::Tensor()};
        const at::Tensor y = y_.unpack(getptr());  // (an output: saved without its node)
        const at::Tensor& dy = grads[0];
        if (!at::GradMode::is_enabled()) {
            if (backward_rows_of(dy, y, dim)) return {softmax_backward_rows(dy, y, dim, log)};
            return {log ? at::_log_softmax_backward_data(dy, y, dim, y.scalar_type())
                        : at::_softmax_backward_data(dy, y, dim, y.scalar_type())};
        }
        const at::Tensor yw = y.to(at::kFloat), dyw = dy.to(at::kFloat);
        const at::Tensor f = log ? yw.exp() : yw;
        const at::Tensor a = log ? dyw : yw * dyw;
        const at::Tensor t = f.sum(dim, true);
        return {at::where(t.eq(0), 0.0, a - f * a.sum(dim, true)).to(y.scalar_type())};
    }
};

// softmax_rows of an x that requires grad, with its graph. fp32: the graph torch's own _softmax
// (_log_softmax) records, its node (SoftmaxBackward0, LogSoftmaxBackward0) saving y, whose backward is
// torch's kernel and whose double backward torch's formula, as native_softmax_graph's: compiled autograd
// captures it, as it cannot capture a node of ours (no compiled_args); bf16: SoftmaxRowsBackward (torch's
// own would run its double backward in 16 bits). Undefined where x has a forward-mode tangent (that graph
// is torch's to make).
at::Tensor softmax_rows_graph(const at::Tensor& x, int64_t dim, bool log) {
    if (torch::autograd::isFwGradDefined(x)) return at::Tensor();
    at::Tensor y = softmax_rows(x, dim, log);
    auto edges = torch::autograd::collect_next_edges(x);
    auto attach = [&](auto node) {
        node->set_next_edges(std::move(edges));
        node->dim = dim;
        node->self_scalar_type = x.scalar_type();
        torch::autograd::set_history(y, node);
        node->result_ = torch::autograd::SavedVariable(y, true);
    };
    if (x.scalar_type() != at::kFloat) {
        auto node = new_node<SoftmaxRowsBackward>();
        node->set_next_edges(std::move(edges));
        node->dim = dim, node->log = log;
        torch::autograd::set_history(y, node);
        node->y_ = torch::autograd::SavedVariable(y, true);
    } else if (log) {
        attach(new_node<torch::autograd::generated::LogSoftmaxBackward0>());
    } else {
        attach(new_node<torch::autograd::generated::SoftmaxBackward0>());
    }
    return y;
}

// The class of row i of the contiguous integer targets t, as int64 (what assert_targets compares)
int64_t target_at(const at::Tensor& t, int64_t i) {
    const void* p = t.const_data_ptr();
    switch (t.scalar_type()) {
        case at::kLong: return static_cast<const int64_t*>(p)[i];
        case at::kInt: return static_cast<const int32_t*>(p)[i];
        case at::kShort: return static_cast<const int16_t*>(p)[i];
        case at::kChar: return static_cast<const int8_t*>(p)[i];
        default: return static_cast<const uint8_t*>(p)[i];
    }
}

bool loss_rows_of(const at::Tensor& x, const at::Tensor& t) {
    if (!rows_of(x, x.dim() - 1) || !t.defined() || !t.device().is_cpu() || !t.has_storage()) return false;
    const auto s = t.scalar_type();
    const bool integer = s == at::kLong || s == at::kInt || s == at::kShort || s == at::kChar || s == at::kByte;
    return integer && t.layout() == at::kStrided && t.is_contiguous() && !t.key_set().has(c10::DispatchKey::Python) &&
           t.numel() * x.size(-1) == x.numel();
}

// cross-entropy's loss of logits x (..., V) and targets t (one per row; loss_rows_of), no class weights,
// smoothing eps, reduction 0 none (a loss per row, shaped (M,)), 1 mean, 2 sum; in x's dtype, computed in
// fp32 per row (the rows' sum in fp64). An undefined tensor with *bad the first row whose target is outside
// [0, V) and not ignore_index, where one is (nothing computed). *kept_out: the rows not ignored; *nan_row:
// whether one of them has a NaN loss (a row whose max is not finite, or holding NaN).
at::Tensor cross_entropy_rows(const at::Tensor& x, const at::Tensor& t, int64_t ignore, int reduction, double eps,
                              int64_t* bad, int64_t* kept_out = nullptr, bool* nan_row = nullptr) {
    RECORD_FUNCTION("fastsoftmax::cross_entropy_rows", std::vector<c10::IValue>({x, t}));
    const int64_t v = x.size(-1), m = x.numel() / v;
    int64_t kept = 0;
    for (int64_t i = 0; i < m; ++i) {
        const int64_t c = target_at(t, i);
        if (c == ignore) continue;
        if (c < 0 || c >= v) {
            *bad = i;
            return at::Tensor();
        }
        ++kept;
    }
    at::Tensor per(at::detail::empty_cpu({m}, at::kFloat));
    float* pp = per.mutable_data_ptr<float>();
    on_rows(x, [&](auto* type) {
        using T = std::remove_pointer_t<decltype(type)>;
        const T* xp = static_cast<const T*>(x.const_data_ptr());
        at::parallel_for(0, m, grain(v), [&](int64_t b, int64_t e) {
            for (int64_t r = b; r < e; ++r) {
                const int64_t c = target_at(t, r);
                pp[r] = c == ignore ? 0.0f : rows::cross_entropy_row(xp + r * v, v, c, float(eps));
            }
        });
    });
    if (kept_out) *kept_out = kept;
    if (nan_row) *nan_row = std::any_of(pp, pp + m, [](float l) { return std::isnan(l); });
    if (reduction == 0) return per.scalar_type() == x.scalar_type() ? per : per.to(x.scalar_type());
    double total = 0.0;
    for (int64_t i = 0; i < m; ++i) total += pp[i];
    if (reduction == 1) total /= double(kept);  // (0 / 0: NaN, as torch's mean over no row)
    at::Tensor loss(at::detail::empty_cpu({}, x.scalar_type()));
    on_rows(x, [&](auto* type) {
        rows::narrow(static_cast<std::remove_pointer_t<decltype(type)>*>(loss.mutable_data_ptr()), float(total));
    });
    return loss;
}

// The backward of cross_entropy_rows_graph's loss: dlogits = (softmax(x) - onehot(t)) * g per kept row (g over
// the kept rows for the mean), 0 on ignored rows, in fp32 rounded to x's dtype once: the row kernels where
// nothing is recorded; torch's ops where a double backward is asked for (create_graph: autograd records them),
// equal to within the fp32 rounding of their sums.
struct CrossEntropyRowsBackward : torch::autograd::Node {
    torch::autograd::SavedVariable x_;
    at::Tensor t_;  // (M,) int64
    int64_t ignore = 0, kept = 0;
    int reduction = 1;

    std::string name() const override { return "CrossEntropyRowsBackward"; }
    void release_variables() override { x_.reset_data(); }
    torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
        if (!grads[0].defined()) return {at::Tensor()};
        const at::Tensor x = x_.unpack();
        if (!at::GradMode::is_enabled()) return {gradient(x, grads[0])};
        const int64_t v = x.size(-1);
        at::Tensor xw = x.reshape({-1, v});
        if (xw.scalar_type() != at::kFloat) xw = xw.to(at::kFloat);
        at::Tensor g = grads[0].to(at::kFloat).reshape({-1, 1});  // (M, 1) for 'none', else (1, 1)
        if (reduction == 1) g = g / double(kept);
        const at::Tensor keep = t_.ne(ignore).unsqueeze(1);
        const at::Tensor hot = at::zeros_like(xw).scatter_(1, at::where(keep, t_.unsqueeze(1), 0), 1.0);
        const at::Tensor dx = at::where(keep, (at::_softmax(xw, 1, false) - hot) * g, 0.0);
        return {dx.to(x.scalar_type()).reshape(x.sizes())};
    }

    // the same in one pass of the row kernels (cross_entropy_backward_row), where nothing is recorded
    at::Tensor gradient(const at::Tensor& x, const at::Tensor& grad) const {
        RECORD_FUNCTION("fastsoftmax::cross_entropy_backward_rows", std::vector<c10::IValue>({x, grad}));
        const at::Tensor g = grad.scalar_type() == at::kFloat ? grad.contiguous() : grad.to(at::kFloat).contiguous();
        const float* gp = g.const_data_ptr<float>();
        const bool per_row = reduction == 0;
        const float scale = reduction == 1 ? float(1.0 / double(kept)) : 1.0f;
        const int64_t* tp = t_.const_data_ptr<int64_t>();
        const int64_t v = x.size(-1), m = x.numel() / v;
        at::Tensor dx = new_like(x, x.scalar_type());
        on_rows(x, [&](auto* type) {
            using T = std::remove_pointer_t<decltype(type)>;
            const T* xp = static_cast<const T*>(x.const_data_ptr());
            T* dxp = static_cast<T*>(dx.mutable_data_ptr());
            at::parallel_for(0, m, grain(v), [&](int64_t b, int64_t e) {
                for (int64_t r = b; r < e; ++r) {
                    if (tp[r] == ignore) {
                        std::memset(static_cast<void*>(dxp + r * v), 0, sizeof(T) * v);
                        continue;
                    }
                    const float gr = (per_row ? gp[r] : gp[0]) * scale;
                    rows::cross_entropy_backward_row(xp + r * v, dxp + r * v, v, tp[r], gr);
                }
            });
        });
        return dx;
    }
};

// cross_entropy_rows of logits that require grad (no smoothing), with CrossEntropyRowsBackward as its
// graph; undefined where a kept row's loss is NaN (the library's gradient there is not this formula's: the
// caller takes its Function) or where x has a forward-mode tangent, or with *bad as cross_entropy_rows.
at::Tensor cross_entropy_rows_graph(const at::Tensor& x, const at::Tensor& t, int64_t ignore, int reduction,
                                    int64_t* bad) {
    if (torch::autograd::isFwGradDefined(x)) return at::Tensor();
    int64_t kept = 0;
    bool nan_row = false;
    at::Tensor loss = cross_entropy_rows(x, t, ignore, reduction, 0.0, bad, &kept, &nan_row);
    if (!loss.defined() || nan_row) return at::Tensor();
    auto node = new_node<CrossEntropyRowsBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(x));
    node->x_ = torch::autograd::SavedVariable(x, false);
    node->t_ = t.reshape({-1}).to(at::kLong);
    node->ignore = ignore, node->kept = kept, node->reduction = reduction;
    torch::autograd::set_history(loss, node);
    return loss;
}

// softmax or log_softmax of a along dim (op FT_SOFTMAX, FT_LOG_SOFTMAX), or their backward of a: dy and b: y
// (FT_SOFTMAX_BACKWARD, FT_LOG_SOFTMAX_BACKWARD, in dtype), on CPU tensors, the GIL released, as
// backends/torch.py's native_softmax and native_softmax_backward compute them for a contiguous tensor: the
// row kernels where they apply (forward: also where autograd records, with their graph); else torch's
// kernels (a 16-bit log_softmax in fp32, rounded once), through the whole dispatcher where autograd records
// or a profiler listens, else called directly (at::cpu::, what the dispatcher reaches for a plain CPU
// tensor); log_softmax's backward through torch's kernel only where no row starts below -100 (torch's kernel
// leaves the library's masked rows to the Python path). The output's address in *address; a new reference,
// NULL with torch's error, or with none where the Python path must run.
PyObject* cpu_op(int op, PyObject* a, PyObject* b, long dim, int dtype, unsigned long long* address) {
    HANDLE_TH_ERRORS
    const at::Tensor& xr = THPVariable_Unpack(a);
    const at::Tensor* yr = b ? &THPVariable_Unpack(b) : nullptr;
    const bool graph = at::GradMode::is_enabled() && (xr.requires_grad() || (yr && yr->requires_grad()));
    const bool backward = op == FT_SOFTMAX_BACKWARD || op == FT_LOG_SOFTMAX_BACKWARD;
    const bool log = op == FT_LOG_SOFTMAX || op == FT_LOG_SOFTMAX_BACKWARD;
    at::Tensor y;
    if (!graph && (backward ? at::ScalarType(dtype) == yr->scalar_type() && backward_rows_of(xr, *yr, dim)
                            : rows_of(xr, dim))) {
        NoGil released;  // (the row kernels copy no handle of their inputs: held by reference, see NoGil)
        y = backward ? softmax_backward_rows(xr, *yr, dim, log) : softmax_rows(xr, dim, log);
    } else {
        const at::Tensor x = xr;  // (by value: see NoGil)
        const at::Tensor y_owned = yr ? *yr : at::Tensor();
        NoGil released;
        const bool direct = !graph && !at::hasCallbacks();
        if (!backward && graph && rows_of(x, dim))  // (the caller hands a bf16 graph over where rows_of fails)
            y = softmax_rows_graph(x, dim, log);
        if (y.defined())
            ;  // (the row kernels, with their graph)
        else if (op == FT_LOG_SOFTMAX_BACKWARD && y_owned.select(dim, 0).lt(-100.0).any().item<bool>())
            return nullptr;  // (a row whose exps may all be 0: the Python path fixes it; the GIL held again)
        else if (op == FT_LOG_SOFTMAX_BACKWARD)
            y = direct ? at::cpu::_log_softmax_backward_data(x, y_owned, dim, at::ScalarType(dtype))
                       : at::_log_softmax_backward_data(x, y_owned, dim, at::ScalarType(dtype));
        else if (op == FT_SOFTMAX)
            y = direct ? at::cpu::_softmax(x, dim, false) : at::_softmax(x, dim, false);
        else if (op == FT_LOG_SOFTMAX && (x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16))
            y = at::_log_softmax(x.to(at::kFloat), dim, false).to(x.scalar_type());  // (fp32 rows, rounded once)
        else if (op == FT_LOG_SOFTMAX)
            y = direct ? at::cpu::_log_softmax(x, dim, false) : at::_log_softmax(x, dim, false);
        else if (direct)
            y = at::cpu::_softmax_backward_data(x, y_owned, dim, at::ScalarType(dtype));
        else
            y = at::_softmax_backward_data(x, y_owned, dim, at::ScalarType(dtype));
    }
    *address = reinterpret_cast<unsigned long long>(y.const_data_ptr());
    return THPVariable_Wrap(std::move(y));
    END_HANDLE_TH_ERRORS
}

// backends/torch.py's native cross-entropy of CPU logits (..., V) (contiguous) and integer targets (...),
// no class weights, one chunk: the row kernels' loss where they apply (fp32 and bf16 logits), else torch's
// loss on fp32 rows (fp64 for fp64 logits), in the logits' dtype;
// graph 1 (logits needing a gradient, no smoothing): torch's log_softmax and nll_loss, its autograd graph
// kept. A new reference; NULL with an error, or with none where the Python path must run (a target out of
// range, whose error is the library's; a row whose log_softmax starts with NaN under graph).
PyObject* cpu_loss(PyObject* logits, PyObject* target, long ignore_index, int reduction, double smoothing,
                   int graph) {
    HANDLE_TH_ERRORS
    const at::Tensor& xr = THPVariable_Unpack(logits);
    const at::Tensor& tr = THPVariable_Unpack(target);
    if (!graph && loss_rows_of(xr, tr)) {  // (the row kernels copy no handle: held by reference, see NoGil)
        int64_t bad = -1;
        at::Tensor loss;
        {
            NoGil released;
            loss = cross_entropy_rows(xr, tr, ignore_index, reduction, smoothing, &bad);
            if (loss.defined() && reduction == 0) loss = loss.reshape(tr.sizes());
        }
        if (!loss.defined()) return nullptr;  // (a bad target, whose error is the library's)
        return THPVariable_Wrap(std::move(loss));
    }
    const at::Tensor x = xr;  // (by value: see NoGil)
    const at::Tensor t = tr;
    at::Tensor loss;
    try {
        NoGil released;
        if (graph && loss_rows_of(x, t) && smoothing == 0.0) {  // (with smoothing: torch's ops)
            int64_t bad = -1;
            loss = cross_entropy_rows_graph(x, t, ignore_index, reduction, &bad);
            if (!loss.defined()) return nullptr;  // (a bad target, whose error is the library's; a NaN row)
        } else {
            const auto wide = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
            // (each reshape or to() is a dispatch: made only where it changes something)
            const at::Tensor xs = x.dim() == 2 ? x : x.reshape({-1, x.size(-1)});
            const at::Tensor xw = xs.scalar_type() == wide ? xs : xs.to(wide);
            at::Tensor ts = t.dim() == 1 ? t : t.reshape({-1});
            if (ts.scalar_type() != at::kLong) ts = ts.to(at::kLong);
            if (graph) {
                at::Tensor ls = at::_log_softmax(xw, 1, false);
                const int64_t m = ls.size(0), v = ls.size(1);
                for (int64_t i = 0; i < m; ++i) {  // (there torch's gradient is not the library's)
                    const bool nan = wide == at::kDouble ? std::isnan(ls.const_data_ptr<double>()[i * v])
                                                         : std::isnan(ls.const_data_ptr<float>()[i * v]);
                    if (nan) return nullptr;
                }
                loss = at::nll_loss_nd(ls, ts, std::nullopt, reduction, ignore_index);
            } else {
                loss = at::cross_entropy_loss(xw, ts, std::nullopt, reduction, ignore_index, smoothing);
            }
            if (loss.scalar_type() != x.scalar_type()) loss = loss.to(x.scalar_type());
        }
        if (reduction == 0) loss = loss.reshape(t.sizes());
    } catch (const c10::IndexError&) {
        return nullptr;  // (the GIL held again: NoGil's destructor ran first)
    }
    return THPVariable_Wrap(std::move(loss));
    END_HANDLE_TH_ERRORS
}

int grad_enabled() { return at::GradMode::is_enabled(); }

const FtCalls calls = {FT_ABI, sizeof(FtMeta), meta, dtype_code, empty_like, cpu_op, cpu_loss, eager, grad_enabled};

// ---- the row kernels from Python: backends/torch.py computes what the C path does ----------------------------

bool tensors(PyObject* const* args, Py_ssize_t k) {
    for (Py_ssize_t i = 0; i < k; ++i)
        if (!THPVariable_Check(args[i])) return false;
    return true;
}

// softmax_rows(x, dim, log) -> softmax_rows's y (with softmax_rows_graph's graph where autograd records), or
// None where the row kernels do not apply
PyObject* py_softmax_rows(PyObject*, PyObject* const* args, Py_ssize_t n) {
    HANDLE_TH_ERRORS
    if (n != 3 || !tensors(args, 1) || !PyLong_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "softmax_rows(x, dim, log)");
        return nullptr;
    }
    const at::Tensor given = THPVariable_Unpack(args[0]);  // (by value: see NoGil)
    const at::Tensor x = given.is_neg() ? given.resolve_neg() : given;  // (its value's rows, as C's path has them)
    const long long dim = PyLong_AsLongLong(args[1]);
    const int log = PyObject_IsTrue(args[2]);
    if (PyErr_Occurred()) return nullptr;
    if (!eager() || !rows_of(x, dim)) Py_RETURN_NONE;
    at::Tensor y;
    {
        NoGil released;
        const bool graph = at::GradMode::is_enabled() && x.requires_grad();
        y = graph ? softmax_rows_graph(x, dim, log) : softmax_rows(x, dim, log);
    }
    if (!y.defined()) Py_RETURN_NONE;
    return THPVariable_Wrap(std::move(y));
    END_HANDLE_TH_ERRORS
}

// softmax_backward_rows(dy, y, dim, log) -> softmax_backward_rows's dx, or None where the backward row kernels
// do not apply (or autograd would record: the caller's graph is its own)
PyObject* py_softmax_backward_rows(PyObject*, PyObject* const* args, Py_ssize_t n) {
    HANDLE_TH_ERRORS
    if (n != 4 || !tensors(args, 2) || !PyLong_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "softmax_backward_rows(dy, y, dim, log)");
        return nullptr;
    }
    const at::Tensor& dy_given = THPVariable_Unpack(args[0]);  // (their values' rows, as C's path has them)
    const at::Tensor& y_given = THPVariable_Unpack(args[1]);
    const at::Tensor dy = dy_given.is_neg() ? dy_given.resolve_neg() : dy_given;  // (by value: see NoGil)
    const at::Tensor y = y_given.is_neg() ? y_given.resolve_neg() : y_given;
    const long long dim = PyLong_AsLongLong(args[2]);
    const int log = PyObject_IsTrue(args[3]);
    if (PyErr_Occurred()) return nullptr;
    const bool graph = at::GradMode::is_enabled() && (dy.requires_grad() || y.requires_grad());
    if (!eager() || graph || !backward_rows_of(dy, y, dim)) Py_RETURN_NONE;
    at::Tensor dx;
    {
        NoGil released;
        dx = softmax_backward_rows(dy, y, dim, log);
    }
    return THPVariable_Wrap(std::move(dx));
    END_HANDLE_TH_ERRORS
}

// cross_entropy_rows(x, t, ignore_index, reduction (0 none, 1 mean, 2 sum), smoothing) -> cross_entropy_rows's
// loss (cross_entropy_rows_graph's where autograd records), or None where the row kernels do not apply or
// the graph cannot be had; IndexError for a target out of range
PyObject* py_cross_entropy_rows(PyObject*, PyObject* const* args, Py_ssize_t n) {
    HANDLE_TH_ERRORS
    if (n != 5 || !tensors(args, 2) || !PyLong_Check(args[2]) || !PyLong_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "cross_entropy_rows(x, t, ignore_index, reduction, smoothing)");
        return nullptr;
    }
    const at::Tensor x = THPVariable_Unpack(args[0]);  // (by value: see NoGil)
    const at::Tensor t = THPVariable_Unpack(args[1]);
    const long long ignore = PyLong_AsLongLong(args[2]);
    const long reduction = PyLong_AsLong(args[3]);
    const double eps = PyFloat_AsDouble(args[4]);
    if (PyErr_Occurred()) return nullptr;
    const bool graph = at::GradMode::is_enabled() && x.requires_grad();
    if (!eager() || !loss_rows_of(x, t) || reduction < 0 || reduction > 2 || (graph && eps != 0.0)) Py_RETURN_NONE;
    at::Tensor loss;
    int64_t bad = -1;
    {
        NoGil released;
        loss = graph ? cross_entropy_rows_graph(x, t, ignore, int(reduction), &bad)
                     : cross_entropy_rows(x, t, ignore, int(reduction), eps, &bad);
    }
    if (bad >= 0)
        return PyErr_Format(PyExc_IndexError, "Target %lld is out of bounds.", (long long)target_at(t, bad));
    if (!loss.defined()) Py_RETURN_NONE;
    return THPVariable_Wrap(std::move(loss));
    END_HANDLE_TH_ERRORS
}

PyObject* table(PyObject*, PyObject*) { return PyCapsule_New(const_cast<FtCalls*>(&calls), FT_CAPSULE, nullptr); }

PyMethodDef methods[] = {
    {"table", table, METH_NOARGS, "the capsule fastlaunch.c takes (fastlaunch_torch.h's FtCalls)"},
    {"softmax_rows", (PyCFunction)(void (*)(void))py_softmax_rows, METH_FASTCALL, "softmax_rows(x, dim, log)"},
    {"softmax_backward_rows", (PyCFunction)(void (*)(void))py_softmax_backward_rows, METH_FASTCALL,
     "softmax_backward_rows(dy, y, dim, log)"},
    {"cross_entropy_rows", (PyCFunction)(void (*)(void))py_cross_entropy_rows, METH_FASTCALL,
     "cross_entropy_rows(x, t, ignore_index, reduction, smoothing)"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "fastlaunch_torch", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_fastlaunch_torch(void) {
    PyObject* m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "VECTOR_FLOATS", rows::W) < 0) Py_CLEAR(m);  // (the build's ISA)
    if (m && PyModule_AddIntConstant(m, "BACKWARD_ROWS_MAX", kBackwardRowsMax) < 0) Py_CLEAR(m);
    return m;
}
