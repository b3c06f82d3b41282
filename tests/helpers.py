"""Test helpers over the library's one reference and one tolerance rule (fastsoftmax.core.reference)."""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from fastsoftmax import heuristics
from fastsoftmax.core.reference import compare, random_logits, special_rows  # noqa: F401

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
WORST: dict[str, float] = {}  # worst err/tol seen per output dtype, printed at the end of the run


def cpu_logits(shape, dtype, seed, special=True):
    """Random logits with outliers; with ``special``, reference.special_rows (all -inf, NaN, +inf, near the
    dtype's top, ...) appended along the first dim of a 2-d shape: rows 5 to 13."""
    gen = torch.Generator().manual_seed(seed)
    x = random_logits(shape, dtype, gen)
    return torch.cat([x, special_rows(shape[-1], dtype, gen)]) if special else x


def run_poisoned(fn, *args, **kwargs):
    """(fn's result, the plans recorded while it ran), outputs the library allocates poisoned with NaN."""
    with heuristics.force(poison=True), heuristics.recording() as plans:
        out = fn(*args, **kwargs)
    return out, plans


def assert_close(y: torch.Tensor, x: torch.Tensor, dim: int, log: bool, out_dtype=None) -> float:
    """y must match the float64 oracle of x under the library's tolerance rule; returns err/tol."""
    err, problem = compare(y, x, dim, log, out_dtype)
    assert problem is None, problem
    key = str(out_dtype or x.dtype).removeprefix("torch.")
    WORST[key] = max(WORST.get(key, 0.0), err)
    return err


def overflowing_grad_inputs(n: int, seed: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(dy, y) in fp16 whose softmax gradient y·(dy - sum(y·dy)) exceeds fp16's range in most elements (y of
    magnitude up to ~1e4, as a caller may pass any y) and stays finite in some: 3 rows of n."""
    gen = torch.Generator().manual_seed(seed)
    y = (random_logits((3, n), torch.float32, gen) * 40).to(torch.float16)
    dy = torch.randn(3, n, generator=gen).to(torch.float16)
    return dy.to(device), y.to(device)


def forward(x, dim=-1, *, log=False, dtype=None, backend="auto", want_lse=False):
    """(y, logsumexp per row or None): fastsoftmax.softmax.forward, for tests that read the logsumexp the
    kernels write beside y."""
    from fastsoftmax.ops.softmax import forward as api_forward

    return api_forward(x, dim, log=log, dtype=dtype, backend=backend, want_lse=want_lse)


def pass_through_mode():
    """A TorchDispatchMode that runs every op as it comes: a dispatch mode on the stack, nothing else."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    return PassThrough()


@contextlib.contextmanager
def triton_hook(runtime, name: str, hook):
    """hook registered as Triton's launch hook `name` (knobs.runtime.launch_enter_hook / launch_exit_hook) for
    the block: a HookChain's add and remove (Triton 3.5 and newer), or the plain attribute (Triton 3.4, where
    the hook is None or one callable)."""
    chain = getattr(runtime, name)
    if hasattr(chain, "add"):
        chain.add(hook)
        try:
            yield
        finally:
            chain.remove(hook)
        return
    setattr(runtime, name, hook)
    try:
        yield
    finally:
        setattr(runtime, name, chain)


GLOO_TIMEOUT_S = 120  # a collective left waiting this long raises on its rank: a hang becomes an error
DEADLINE_S = 420  # a spawn still running after this is killed and the test fails (a hang)


def _gloo_child(rank, world, init_file, fn, args, timeout_s=GLOO_TIMEOUT_S):
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # The rank ends here, without the interpreter's teardown and C++'s static destructors: after a DTensor
    # collective torch still holds its process groups, so their gloo threads (an I/O loop, two workers each)
    # outlive destroy_process_group and ran on through the teardown, where a rank can abort (CI saw one:
    # "terminate called without an active exception"). torch.distributed.nn.functional binds the default
    # group into its functions' defaults when first imported (after init, by the first functional
    # collective); DTensor's redistribute-planner cache keeps each DeviceMesh, whose registry keeps its groups.
    # (A failing fn still raises to torch.multiprocessing, which reports its traceback.)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_gloo(
    tmp_path, monkeypatch, fn, world, *args, interpret=False, timeout_s=GLOO_TIMEOUT_S, deadline_s=DEADLINE_S
):
    """fn(rank, world, *args) on ``world`` CPU processes in one gloo group (a file:// store in tmp_path, no
    network ports) whose collectives raise after waiting ``timeout_s``; fails, the processes killed, after
    ``deadline_s``. ``interpret``: the children keep TRITON_INTERPRET=1 (backend='triton' runs the kernels in
    Triton's interpreter); else torch ops only."""
    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if os.path.exists("/sys/class/net/lo") and "GLOO_SOCKET_IFNAME" not in os.environ:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # gloo's traffic stays on the loopback interface
    ctx = mp.spawn(_gloo_child, args=(world, str(tmp_path / "store"), fn, args, timeout_s), nprocs=world, join=False)
    end = time.monotonic() + deadline_s
    while not ctx.join(timeout=max(1.0, end - time.monotonic())):
        if time.monotonic() >= end:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join()
            pytest.fail(f"{fn.__name__} on {world} processes: no result after {deadline_s} s (a hang?)")


def ref_loss(logits, target, ignore_index=-100, reduction="mean", eps=0.0, class_weight=None, softcap=None, z_loss=0.0):
    """(loss, z_term) in float64: softcap first, then torch's F.cross_entropy (weight=, label_smoothing=) plus
    z_loss * logsumexp(z)^2 per row not ignored, reduced over the rows not ignored (the mean: by their
    number, not by the weight sum). Differentiable in logits when it is a float64 leaf."""
    v = logits.shape[-1]
    x = logits.double().reshape(-1, v)
    t = target.reshape(-1).long()
    z = softcap * torch.tanh(x / softcap) if softcap is not None else x
    w = class_weight.double() if class_weight is not None else None
    ce = F.cross_entropy(z, t, weight=w, label_smoothing=eps, reduction=reduction, ignore_index=ignore_index)
    keep = t != ignore_index
    zrow = torch.where(keep, z_loss * torch.logsumexp(z, -1).square(), 0.0)
    if reduction == "mean":
        zterm = zrow.sum() / keep.sum()
    elif reduction == "sum":
        zterm = zrow.sum()
    else:
        ce, zrow = ce.reshape(target.shape), zrow.reshape(target.shape)
        zterm = zrow
    return ce + zterm, zterm


# ---- tensor-parallel problems (test_tp*.py) ---------------------------------------------------------------
# Each rank holds a shard of the classes of one small problem and checks its values and gradients against
# float64 torch on the gathered problem, which every rank builds itself from the same seeds.

M, V = 9, 23  # cross_entropy's rows and classes
N, D = 13, 8  # linear_cross_entropy's rows and features
CAP, ZL, EPS = 15.0, 1e-3, 0.1
IGNORED = (1, 4)  # rows of targets() that are ignore_index (row 1 is -inf everywhere in masked logits)
TP_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-10, atol=1e-12)}
TP_LCE_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-10, atol=1e-11)}
LCE_MEMORY = 160  # bytes of logits a chunk may hold: 1-13 rows a chunk for these shards (several chunks)
# every option at once; class_weight True: the full weights, each rank passing its slice (split_options)
ALL_OPTIONS = {"class_weight": True, "label_smoothing": EPS, "softcap": CAP, "z_loss": ZL, "return_z_loss": True}


def ref_cross_entropy(logits, target, *, label_smoothing=0.0, **options):
    """ref_loss with fs.cross_entropy's keyword for the smoothing: (loss, z-loss term) in float64."""
    return ref_loss(logits, target, eps=label_smoothing, **options)


def leaf64(t):
    """A float64 copy of t that requires grad (a new leaf: t.double() would be t itself for float64)."""
    return t.detach().to(torch.float64, copy=True).requires_grad_()


def ref_grad(loss, x64, grad, target, ignore_index):
    """d loss / d x64 for the upstream ``grad``; 0 on ignored rows (the library's rule; torch's
    log_softmax gives NaN there for a row that is -inf everywhere)."""
    (dx,) = torch.autograd.grad(loss, x64, grad.double(), retain_graph=True)
    dx = dx.reshape(-1, dx.shape[-1])
    dx[target.reshape(-1).long() == ignore_index] = 0.0
    return dx.reshape(x64.shape)


def close(got, want, dtype, what, tol=TP_TOL):
    """got within tol[dtype] of want (NaN equal to NaN, inf to inf of the same sign). torch.isclose rather
    than torch.testing.assert_close, whose first call imports torch.distributed.tensor (seconds a process)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    rtol, atol = tol[dtype]["rtol"], tol[dtype]["atol"]
    ok = torch.isclose(got, want, rtol=rtol, atol=atol, equal_nan=True)
    if not bool(ok.all()):
        i = tuple((~ok).nonzero()[0].tolist())
        err = ((got - want).abs() / (atol + rtol * want.abs())).nan_to_num(float("inf")).max().item()
        raise AssertionError(
            f"{what}: {int((~ok).sum())} of {ok.numel()} elements differ, at {i} {got[i].item()!r} vs "
            f"{want[i].item()!r}; worst |err| / (atol + rtol |want|) = {err:.3g} (rtol {rtol}, atol {atol})"
        )


def upstream(reduction, shape, dtype):
    """A non-unit upstream gradient: 0.7 for a reduced loss, one per row in [0.5, 1.5] for reduction='none'."""
    if reduction == "none":
        n = 1
        for s in shape:
            n *= s
        return torch.linspace(0.5, 1.5, n, dtype=dtype).reshape(shape)
    return torch.tensor(0.7, dtype=dtype)


def ce_logits(dtype, masked=True, rows=M, seed=11):
    """(rows, V) logits of scale 4 with outliers (80, -80); ``masked``: row 1 -inf everywhere, row 2 -inf on
    classes 0-11 and row 6 on 11-22 (whole shards of the splits below)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, V, generator=g, dtype=torch.float64) * 4
    x[3, 5] = 80.0
    x[5, 19] = -80.0
    if masked:
        x[1] = float("-inf")
        x[2, :12] = float("-inf")
        x[6, 11:] = float("-inf")
    return x.to(dtype)


def targets(rows=M, ignore_index=-100):
    """Global class indices, rows IGNORED ignore_index; rows 2 and 6 aim at classes their masked logits keep,
    row 7 at the last class."""
    t = torch.arange(rows) * 5 % V
    for r, c in ((2, V - 1), (6, 0), (7, V - 1)) + tuple((r, ignore_index) for r in IGNORED):
        if r < rows:
            t[r] = c
    return t


def class_weights(dtype, seed=3, v=V):
    """Positive class weights, every fifth (class 0 among them) 0."""
    w = torch.rand(v, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.2
    w[::5] = 0.0
    return w.to(dtype)


def split_options(opts, dtype, lo, hi, v=V):
    """(the rank's options: its class-weight slice; the reference's: the full weights)."""
    local, full = dict(opts), dict(opts)
    if opts.get("class_weight"):
        w = class_weights(dtype, v=v)
        local["class_weight"], full["class_weight"] = w[lo:hi], w
    full.pop("return_z_loss", None)
    return local, full


def bounds(widths, rank):
    lo = sum(widths[:rank])
    return lo, lo + widths[rank]


def same_on_every_rank(t: torch.Tensor) -> bool:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return all(torch.equal(o, t) for o in out)


def lce_problem(dtype, rows=N, ignore_index=-100, seed=21, v=V):
    """(x (rows, D), W (v, D), b (v,), targets): logits of scale ~2, one of 80 + b[5] (row 3, class 5),
    rows 1 and 8 ignored."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, D, generator=g, dtype=torch.float64)
    w = torch.randn(v, D, generator=g, dtype=torch.float64) * 0.7
    b = torch.randn(v, generator=g, dtype=torch.float64)
    x[3] = w[5] * (80.0 / w[5].dot(w[5]))
    t = torch.randint(0, v, (rows,), generator=g)
    t[3] = 0
    for r in (1, 8):
        if r < rows:
            t[r] = ignore_index
    return x.to(dtype), w.to(dtype), b.to(dtype), t


def lce_one(fsd, rank, lo, hi, dtype, opts, reduction, *, bias=True, memory=LCE_MEMORY, shape=None, wrt="xwb",
             backend="auto", tol=TP_LCE_TOL, what="", dev="cpu", v=V, rows=N):  # fmt: skip
    """One call against F.cross_entropy(F.linear(x, W, b)) in float64: the loss (and z-loss term), dx (full,
    the same on every rank), dW and db (the rank's slices); ``v`` classes, ``rows`` rows (or ``shape``)."""
    ii = opts.get("ignore_index", -100)
    rows = rows if shape is None else shape[0] * shape[1]
    x, w, b, t = lce_problem(dtype, rows=rows, ignore_index=ii, v=v)
    if shape is not None:
        x, t = x.reshape(*shape, D), t.reshape(shape)
    local, full = split_options(opts, dtype, lo, hi, v=v)
    xr = x.to(dev, copy=True).requires_grad_("x" in wrt)
    wr = w[lo:hi].to(dev, copy=True).requires_grad_("w" in wrt)
    br = b[lo:hi].to(dev, copy=True).requires_grad_("b" in wrt) if bias else None
    local = {k: v.to(dev) if torch.is_tensor(v) else v for k, v in local.items()}
    out = fsd.linear_cross_entropy(xr, wr, t.to(dev), br, reduction=reduction, memory=memory, backend=backend, **local)
    loss, z = out if opts.get("return_z_loss") else (out, None)
    x64, w64 = leaf64(x), leaf64(w)
    b64 = leaf64(b) if bias else None
    ref, zref = ref_cross_entropy(F.linear(x64, w64, b64), t, reduction=reduction, **full)
    assert loss.dtype == dtype and loss.shape == ref.shape, (what, loss.dtype, loss.shape)
    close(loss, ref, dtype, f"{what}: loss", tol)
    if z is not None:
        close(z, zref, dtype, f"{what}: z-loss term", tol)
    ours = [p for p, k in ((xr, "x"), (wr, "w"), (br, "b")) if p is not None and k in wrt]
    refs = [p for p, k in ((x64, "x"), (w64, "w"), (b64, "b")) if p is not None and k in wrt]
    g = upstream(reduction, ref.shape, dtype)
    got = torch.autograd.grad(loss, ours, g.to(dev))
    want = torch.autograd.grad(ref, refs, g.double())
    for p, dp, dref in zip(ours, got, want, strict=True):
        name = "dx" if p is xr else "dW" if p is wr else "db"
        assert dp.shape == p.shape and dp.dtype == p.dtype, (what, name, dp.shape, dp.dtype)
        close(dp, dref if p is xr else dref[lo:hi], dtype, f"{what}: {name}", tol)
        if p is xr:
            assert same_on_every_rank(dp), f"{what}: dx differs between ranks"
