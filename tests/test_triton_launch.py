"""triton/launch.py without a GPU: a Triton kernel's signature packed into a launch.Launch (kernels compiled
for sm_90 by the installed Triton, and stand-ins for every kernel the launcher refuses), the compiled-kernel
memo, and the full path (a prepared launch, retried, recorded; Triton's own launch under the interpreter or
a launch hook) driven through a stand-in of fastlaunch."""

import ctypes
import math
import os
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import triton_hook

from fastsoftmax.core.errors import BackendFailed
from fastsoftmax.kernels import launch
from fastsoftmax.kernels.triton import launch as tl


class _Launcher:
    """fastlaunch as a stand-in: each call kept as (Desc address, stream, addresses); the codes queued, then 0."""

    def __init__(self):
        self.calls, self.codes = [], []

    def launch(self, desc, stream, *addresses):
        self.calls.append((desc, stream, addresses))
        return self.codes.pop(0) if self.codes else 0


@pytest.fixture
def launcher(monkeypatch):
    """Launches made through a stand-in of fastlaunch (no C build), in caches of this test's own."""
    fake = _Launcher()
    monkeypatch.setattr(launch, "_native_mod", [fake])
    monkeypatch.setattr(launch, "_launches", {})
    monkeypatch.setattr(tl, "_plans", {})
    return fake


def _bytes(desc) -> bytes:
    return ctypes.string_at(ctypes.addressof(desc) + launch.Desc.bytes.offset, desc.n_bytes)


class _Ck(SimpleNamespace):
    """A CompiledKernel as triton/launch.py reads it (hashable, as Triton's are)."""

    __hash__ = object.__hash__
    __eq__ = object.__eq__


_METADATA = dict(num_warps=4, shared=128, num_ctas=1, launch_pdl=False, launch_cooperative_grid=False, name="k")
_METADATA |= dict(global_scratch_size=0, global_scratch_align=1, profile_scratch_size=0, profile_scratch_align=1)


def _fake_ck(signature, **meta):
    """A CompiledKernel with this signature and metadata (a field given as ...: absent, as in older Triton)."""
    md = SimpleNamespace(**{k: v for k, v in (_METADATA | meta).items() if v is not ...})
    return _Ck(metadata=md, src=SimpleNamespace(signature=signature), function=0xABC, name="k")


SIG = {"x": "*bf16", "y": "*bf16", "n": "i32", "BLOCK": "constexpr", "scale": "fp32", "flag": "i1", "g": "i8",
       "w": "*fp32", "big": "i64", "u": "u64", "h": "i16", "v": "u8", "f64": "fp64"}  # fmt: skip


def test_signature_packed_into_a_launch(launcher):
    """Constexprs dropped, pointers as 8-byte address slots in order, integers and floats by their types
    (narrower integers in 32-bit storage, sign- or zero-extended), Triton's global and profile scratch
    pointers last (null; before Triton 3.5 no profile one, before 3.2 neither); block = 32 x num_warps, the
    kernel's shared memory, the grid padded to three dims; the handle loaded where it is not yet."""
    plan = tl.KernelPlan(_fake_ck(SIG), list(SIG), [None] * len(SIG))
    assert [n for _, n, _ in plan.runtime] == [n for n in SIG if n != "BLOCK"] and plan.trailing == 2
    assert (plan.pointers, plan.floats, plan.what) == ([0, 1, 6], [3, 11], "the Triton kernel k's launch")
    values = [0, 0, 4096, 0.5, True, -2, 0, -3, 2**64 - 1, -5, 200, 0.25]
    ln = plan.launch((3, 2), values)
    d = ln.desc
    assert (d.function, list(d.grid), d.block, d.smem, d.cluster) == (0xABC, [3, 2, 1], 128, 128, 1)
    assert d.n_params == 14 and list(d.offsets[:14]) == [0, 8, 16, 20, 24, 28, 32, 40, 48, 56, 60, 64, 72, 80]
    assert ln.fills == [[0], [8], [32]] and d.n_bytes == 88
    raw = _bytes(d)
    assert struct.unpack_from("<ifii", raw, 16) == (4096, 0.5, 1, -2)
    assert struct.unpack_from("<QqQiIdQQ", raw, 32) == (0, -3, 2**64 - 1, -5, 200, 0.25, 0, 0)
    old = tl.KernelPlan(_fake_ck(SIG, profile_scratch_size=..., profile_scratch_align=...), list(SIG), [None] * 13)
    assert old.trailing == 1 and old.launch((1,), values).desc.n_params == 13
    older = tl.KernelPlan(_fake_ck(SIG, profile_scratch_size=..., global_scratch_size=...), list(SIG), [None] * 13)
    assert older.trailing == 0
    ck = _fake_ck(SIG)
    ck.function = None
    ck._init_handles = lambda: setattr(ck, "function", 0xDEF)
    assert tl.KernelPlan(ck, list(SIG), [None] * 13).function == 0xDEF


def test_kernels_the_launcher_cannot_make_are_refused(launcher):
    """What launch.py does not make raises errors.BackendFailed when the plan is made, naming it."""
    cases = [
        (_fake_ck(SIG, global_scratch_size=256), "global or profile scratch"),
        (_fake_ck(SIG, profile_scratch_size=64), "global or profile scratch"),
        (_fake_ck(SIG, num_ctas=2), "num_ctas > 1"),
        (_fake_ck(SIG, num_ctas=..., cluster_dims=(2, 1, 1)), "num_ctas > 1"),
        (_fake_ck(SIG, launch_cooperative_grid=True), "cooperative grid"),
        (_fake_ck(SIG, launch_pdl=True), "programmatic dependent launch"),
        (_fake_ck(SIG, tensordesc_meta=[{"swizzle": 128}]), "TMA descriptors"),
        (_fake_ck({**SIG, "t": "tensordesc<bf16[64, 64]>"}), "TMA descriptors"),
        (_fake_ck({**SIG, "t": "nvTmaDesc"}), "TMA descriptors"),
        (_fake_ck(SIG, instrumentation_mode="gsan"), "GSan"),
        (_fake_ck(SIG, shared=300 * 1024), "oversized shared memory"),
        (_fake_ck({**SIG, "t": ("i32", "i32")}), "tuple argument"),
        (_fake_ck({**SIG, "t": "fp16"}), "of type fp16"),
        (_fake_ck({**SIG, **{f"p{i}": "*fp32" for i in range(launch.MAX_ADDRESSES)}}), "more arguments than a"),
    ]
    for ck, why in cases:
        names = list(ck.src.signature)
        with pytest.raises(BackendFailed, match=why):
            tl.KernelPlan(ck, names, [None] * len(names))
    with pytest.raises(BackendFailed, match="not one type per argument"):
        tl.KernelPlan(_fake_ck(SIG), [*SIG, "extra"], [None] * 14)
    for ck in (_fake_ck(SIG, num_ctas=..., cluster_dims=(1, 1, 1)), _fake_ck(SIG, shared=228 * 1024)):
        assert tl.KernelPlan(ck, list(SIG), [None] * 13).smem == ck.metadata.shared  # (the limits themselves)


_COMPILED_PARAMS = r'''
import re, struct, sys
import torch, triton, triton.language as tl
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
    backend = make_backend(GPUTarget("cuda", 90, 32))
except Exception as e:  # Triton's internals used here moved: nothing to check against
    print("SKIP", repr(e)); sys.exit(0)
from fastsoftmax import heuristics
from fastsoftmax.core.options import Loss
from fastsoftmax.kernels import launch
from fastsoftmax.kernels.triton import cross_entropy, launch as tlaunch, softmax_bwd, softmax_fwd

@triton.jit
def every_type(p, a, b, c, d, e, f, g, h, i, j, k):
    v = a.to(tl.float32) + b.to(tl.float32) + c.to(tl.float32) + d.to(tl.float32) + e.to(tl.float32)
    v += f.to(tl.float32) + g.to(tl.float32) + h.to(tl.float32) + i.to(tl.float32) + j + k.to(tl.float32)
    tl.store(p, v)

WIDTH = {"u64": 8, "b64": 8, "s64": 8, "f64": 8, "u32": 4, "b32": 4, "s32": 4, "f32": 4, "u16": 2, "b16": 2,
         "s16": 2, "u8": 1, "b8": 1, "s8": 1}

def check(kernel, ck, values):
    """The PTX's parameters against the plan's: as many; at each scalar's offset, its value at the declared
    width (the driver reads that many bytes from the start of the storage); 64-bit at the address slots."""
    ck.function = 1  # (what _init_handles loads on a GPU)
    plan = tlaunch.kernel_plan(kernel, ck)
    params, slots = plan.params(values)
    raw, offsets = launch.pack(params)
    name = ck.metadata.name  # (its parameters: not those of a function it calls, such as __assertfail)
    declared = re.findall(rf"\.param\s+\.(\w+)(?:\s+\.ptr[^,\n]*?)?\s+{name}_param_\d+", ck.asm["ptx"])
    assert len(declared) == len(params), (name, declared, params)
    assert all(declared[i] == "u64" for (i, _), in slots), (name, declared, slots)
    for k, (ty, v) in enumerate(zip(plan.types, values)):
        if not ty.startswith("*"):
            w = WIDTH[declared[k]]
            want = struct.pack("<f" if w == 4 else "<d", v) if ty.startswith("fp") else int(v).to_bytes(
                w, "little", signed=ty[0] == "i")
            assert raw[offsets[k] : offsets[k] + w] == want, (name, k, ty, declared[k], v)
    assert plan.block == 32 * ck.metadata.num_warps and plan.smem == ck.metadata.shared

sig = dict(p="*fp32", a="i1", b="i8", c="i16", d="i32", e="i64", f="u8", g="u16", h="u32", i="u64", j="fp32", k="fp64")
ck = triton.compile(ASTSource(fn=every_type, signature=sig, constexprs={}, attrs={}), target=backend.target)
check(every_type, ck, [None, True, -2, -300, -70000, -(2**40), 200, 60000, 4000000000, 2**64 - 1, 0.5, 0.25])

captured = []
softmax_fwd.launch = softmax_bwd.launch = cross_entropy.launch = lambda *a: captured.append(a)
x = torch.randn(8, 65536, dtype=torch.bfloat16)
with heuristics.force(path="split"):
    softmax_fwd.forward(x, 1, x.dtype, False, False)
with heuristics.force(path="rowblock"):
    softmax_bwd.backward(torch.randn(64, 1000), torch.randn(64, 1000), 1, torch.float32, True)
x, t, o = torch.randn(16, 1000), torch.randint(0, 1000, (16,)), Loss(-100, "mean", 0.1, 30.0, 1e-4)
cross_entropy.forward(x, t, None, o, torch.float32, check=True)  # (one program, with the debug finish)
cross_entropy.forward(torch.randn(40, 1000), torch.randint(0, 1000, (40,)), None, o, torch.float32, check=True)
cross_entropy.backward(x, t, None, torch.zeros(19), torch.ones(()), o, torch.float32)
for kernel, grid, args, kwargs in captured:
    try:  # the JIT's own binder and signature, as kernel[grid](...) makes them, without a GPU
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    except Exception as e:
        print("SKIP", repr(e)); sys.exit(0)
    ck = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=backend.target,
                        options=options.__dict__)
    ck.function = 1
    plan = tlaunch.kernel_plan(kernel, ck)
    check(kernel, ck, [args[i] if i < len(args) else kwargs.get(n, d) for i, n, d in plan.runtime])
print("OK", len(captured) + 1)
'''


def test_compiled_kernels_take_the_parameters_packed(tmp_path):
    """Kernels compiled for sm_90 by the installed Triton (its own binder and compiler, no GPU): a kernel of
    every scalar type the plan packs, and the library's at their launches (the split forward's two, the
    rowblock backward with its register cap, the loss's: its one-program forward with the debug finish, its
    rows and debug finish, its backward): each packed parameter list matches the PTX's (see check in the
    script)."""
    script = tmp_path / "compiled_params.py"  # (a file: Triton's JIT reads its kernels' source)
    script.write_text(_COMPILED_PARAMS)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = str(Path(__file__).parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    if out.stdout.startswith("SKIP"):
        pytest.skip(f"this Triton's binder cannot be driven without a GPU: {out.stdout.strip()}")
    assert out.stdout.strip() == "OK 8", out.stdout


def test_the_interpreter_keeps_tritons_own_launch(monkeypatch, device):
    """CPU tensors (Triton's interpreter): kernel[grid](...) runs, never a prepared launch."""
    import fastsoftmax as fs

    if device != "cpu":
        pytest.skip("the Triton kernels are compiled, not interpreted, under --device cuda")

    def refuse(*a, **k):
        raise AssertionError("a prepared launch under the interpreter")

    monkeypatch.setattr(tl, "compiled", refuse)
    monkeypatch.setattr(launch.Launch, "__init__", refuse)
    x = torch.randn(4, 40)
    torch.testing.assert_close(fs.softmax(x, backend="triton"), torch.softmax(x, -1))


class _Tensor:
    """A CUDA tensor as triton/launch.py reads one (no GPU here)."""

    def __init__(self, address, is_cuda=True):
        self.address, self.is_cuda = address, is_cuda

    def data_ptr(self):
        return self.address

    def get_device(self):
        return 0


class _Kernel:
    """A JITFunction as triton/launch.py drives it: run(..., warmup=True) gives the CompiledKernel."""

    def __init__(self, ck, names, defaults):
        self.ck, self.arg_names, self.runs, self.launched = ck, names, [], []
        self.params = [SimpleNamespace(has_default=d is not None, default=d) for d in defaults]

    def run(self, *args, grid, warmup, **kwargs):
        assert warmup
        self.runs.append((args, kwargs))
        return self.ck

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launched.append((grid, args, kwargs))


def test_full_path_launches_a_cached_launch(launcher, monkeypatch):
    """triton/launch.launch on CUDA tensors: the compiled kernel from run(warmup=True), the runtime values from
    the positional arguments, the keywords and the defaults; one Launch per (kernel, grid, scalar values: -0.0
    apart from 0.0) called with the pointers' addresses on torch's current stream; INVALID_CONTEXT: a context
    made current and the launch again; another error: errors.BackendFailed; recorded once launched. With a
    launch hook registered, or under the interpreter, kernel[grid](...) instead, the recording marked."""
    fake, contexts = launcher, []
    monkeypatch.setattr(launch, "ensure_context", contexts.append)
    monkeypatch.setattr(launch, "raw_stream", lambda: lambda index: 0x5EED + index)
    sig = {"x": "*fp32", "y": "*fp32", "n": "i32", "scale": "fp32", "BLOCK": "constexpr", "tail": "i32"}
    kernel = _Kernel(_fake_ck(sig), list(sig), [None] * 5 + [7])
    x, y = _Tensor(0x1000), _Tensor(0x2000)
    kw = dict(scale=0.5, BLOCK=128, num_warps=4)
    runs = []
    for scale, more in ((0.5, {}), (0.5, {}), (-0.0, {}), (0.0, {}), (0.0, {"tail": 9})):
        tl.launch(kernel, (4,), (x, y, 100), kw | dict(scale=scale, **more))
        runs.append(len(kernel.runs))
    descs = [d for d, _, _ in fake.calls]
    assert descs[0] == descs[1] and len(set(descs)) == 4 and runs[:2] == [1, 1] and not kernel.launched
    assert [c[1:] for c in fake.calls] == [(0x5EED, (0x1000, 0x2000))] * 5
    raw = [ctypes.string_at(d + launch.Desc.bytes.offset, launch.Desc.from_address(d).n_bytes) for d in descs]
    assert struct.unpack_from("<QQifi4xQQ", raw[0]) == (0, 0, 100, 0.5, 7, 0, 0)
    assert [struct.unpack_from("<ifi", r, 16) for r in raw[2:]] == [(100, -0.0, 7), (100, 0.0, 7), (100, 0.0, 9)]
    assert [math.copysign(1, struct.unpack_from("<f", r, 20)[0]) for r in raw[2:4]] == [-1, 1]
    last = launch.Desc.from_address(descs[4])
    assert list(last.grid) == [4, 1, 1] and last.n_slots == 2
    assert kernel.runs[0] == ((x, y, 100), kw) and last.n_slots == 2
    rec = launch.start()
    try:
        fake.codes = [launch.INVALID_CONTEXT]
        tl.launch(kernel, (4,), (x, y, 100), kw)
        assert contexts == [0] and fake.calls[-2:] == [(descs[0], 0x5EED, (0x1000, 0x2000))] * 2
        assert [(ln.desc.function, values) for ln, values in rec.launches] == [(0xABC, (x, y))]
        fake.codes = [700]
        with pytest.raises(BackendFailed, match=f"the Triton kernel k's launch failed: {launch.error_name(700)}"):
            tl.launch(kernel, (4,), (x, y, 100), kw)
        assert len(rec.launches) == 1 and rec.ok  # a failed launch is not recorded
        n = len(fake.calls)
        with triton_hook(__import__("triton").knobs.runtime, "launch_enter_hook", lambda *a: None):
            tl.launch(kernel, (4,), (x, y, 100), kw)
        assert kernel.launched == [((4,), (x, y, 100), kw)] and len(fake.calls) == n and not rec.ok
        rec.ok = True
        tl.launch(kernel, (4,), (_Tensor(0x3000, is_cuda=False), y, 100), kw)
        assert len(kernel.launched) == 2 and len(fake.calls) == n and not rec.ok
    finally:
        launch.abort()


def test_compiled_asks_triton_once_per_specialisation():
    """compiled(): Triton asked again only where its specialisation could differ (a tensor's dtype or 16-byte
    alignment, an int's == 1, divisibility by 16 or 64-bit range, a keyword, the device), not for another
    address, another multiple of 16 or another float; an asynchronous compile's future resolved; no kernel
    (a jit_cache_hook skipped it): errors.BackendFailed."""
    runs = []

    class Kernel:  # (hashable, as a JITFunction)
        ck = "ck"

        def run(self, *args, grid, warmup, **kwargs):
            runs.append(args)
            return self.ck

    kernel = Kernel()
    buf = torch.empty(64)

    def ask(*args, device=0, **kwargs):
        return tl.compiled(kernel, (1,), args, kwargs, device)

    assert ask(buf[:8], 16, 0.5, BLOCK=64) == "ck" and len(runs) == 1
    assert ask(buf[4:12], 32, 0.25, BLOCK=64) == "ck" and len(runs) == 1
    for args, kwargs, device in [
        ((buf[1:9], 16, 0.5), {"BLOCK": 64}, 0),
        ((buf[:8].double(), 16, 0.5), {"BLOCK": 64}, 0),
        ((buf[:8], 17, 0.5), {"BLOCK": 64}, 0),
        ((buf[:8], 1, 0.5), {"BLOCK": 64}, 0),
        ((buf[:8], 2**31, 0.5), {"BLOCK": 64}, 0),
        ((buf[:8], 16, 0.5), {"BLOCK": 128}, 0),
        ((buf[:8], 16, 0.5), {"BLOCK": 64}, 1),
    ]:
        n = len(runs)
        ask(*args, device=device, **kwargs)
        assert len(runs) == n + 1, (args, kwargs, device)
    kernel.ck = SimpleNamespace(result=lambda: "resolved")
    assert ask(buf[:8], 48, 0.5, BLOCK=256) == "resolved"
    kernel.ck = None
    with pytest.raises(BackendFailed, match="compiled no kernel"):
        ask(buf[:8], 16, 0.5, BLOCK=512)


def test_every_kernel_fits_a_prepared_launch():
    """Every Triton kernel the library launches (its pointer arguments named *_ptr) has at most
    launch.MAX_ADDRESSES of them and at most MAX_PARAMS parameters with Triton's two scratch pointers, so its
    prepared launch can be built. shard_apply's 9 addresses did not fit the 8 a Desc held: only a GPU run
    found it (BackendFailed at its first launch); the interpreter never builds a Desc."""
    import importlib
    import inspect
    import pkgutil

    import fastsoftmax.kernels.triton as kernels

    seen = {}
    for mod_info in pkgutil.iter_modules(kernels.__path__):
        mod = importlib.import_module(f"fastsoftmax.kernels.triton.{mod_info.name}")
        for name, k in vars(mod).items():  # (@triton.jit functions, compiled or interpreted)
            fn = getattr(k, "fn", None)
            if callable(fn) and hasattr(k, "arg_names") and fn.__module__ == mod.__name__:
                params = inspect.signature(fn).parameters.values()
                runtime = [p.name for p in params if "constexpr" not in str(p.annotation)]
                if any(n.endswith("_ptr") for n in runtime) and not name.startswith("_"):
                    seen[name] = (sum(n.endswith("_ptr") for n in runtime), len(runtime) + 2)
    assert {"shard_apply", "shard_stats", "ce_bwd", "softmax_fwd_split_write"} <= set(seen), sorted(seen)
    too_many = {n: c for n, c in seen.items() if c[0] > launch.MAX_ADDRESSES or c[1] > launch.MAX_PARAMS}
    limits = f"{launch.MAX_ADDRESSES}, {launch.MAX_PARAMS}"
    assert not too_many, f"(addresses, parameters) past a Desc's {limits}: {too_many}"
