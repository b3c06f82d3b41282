"""launch.py without a GPU: the argument bytes a prepared launch hands the driver, the driver structures'
layouts (cuda.h, 64-bit), fastlaunch.c built (or loaded from the cache) and agreeing with launch.Desc, a
Triton kernel's signature packed into a Launch (triton/launch.py) and the kernels it refuses, and the
replay's recording mapped to roles (fastpath.finish)."""

import ctypes
import gc
import shutil
import struct
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import pass_through_mode, triton_hook

from fastsoftmax import heuristics, torch_build
from fastsoftmax.kernels import replay as fastpath
from fastsoftmax.kernels import launch
from fastsoftmax.kernels.torch_ops import native_softmax
from fastsoftmax.kernels.cuda.kernels import _Params
from fastsoftmax.core.errors import BackendFailed


def test_pack_lays_parameters_out_as_the_compiler_does():
    p = _Params(0x1000, 0x2000, None, None, 5, 1, *range(11), 4097, 1)
    args = [
        (ctypes.c_uint64, 7),
        (ctypes.c_int32, -3),
        (ctypes.c_float, 1.5),
        (ctypes.c_int8, 1),
        (ctypes.c_uint64, 9),
        (_Params, p),
        (ctypes.c_int64, -2),
    ]
    raw, offsets = launch.pack(args)
    assert offsets == [0, 8, 12, 16, 24, 32, 32 + ctypes.sizeof(_Params)]
    assert struct.unpack_from("<Qifb", raw, 0) == (7, -3, 1.5, 1)
    assert struct.unpack_from("<Q", raw, 24) == (9,)
    assert raw[32 : 32 + ctypes.sizeof(_Params)] == bytes(p)
    assert struct.unpack_from("<q", raw, offsets[-1]) == (-2,)


def _can_build() -> bool:
    include = sysconfig.get_paths().get("include")
    return bool((shutil.which("cc") or shutil.which("gcc")) and include and Path(include, "Python.h").exists())


needs_cc = pytest.mark.skipif(not _can_build(), reason="no C compiler or Python headers here")


@pytest.fixture
def native(tmp_path, monkeypatch):
    """fastlaunch built afresh into a private cache."""
    monkeypatch.setenv("FASTSOFTMAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(launch, "_native_mod", [])
    return launch.native()


@needs_cc
def test_driver_structures(native):
    """fastlaunch.c's CUlaunchAttribute (cluster dimension) and CUlaunchConfig as cuda.h lays them out."""
    attr_size, attr_x, cfg_size, smem, stream, attrs, num_attrs = native.driver_layout()
    assert (attr_size, attr_x) == (72, 8)
    assert (cfg_size, smem, stream, attrs, num_attrs) == (56, 24, 32, 40, 48)


@needs_cc
def test_native_launcher_builds_and_agrees_on_desc(native, tmp_path):
    """fastlaunch.c compiles, loads, has launch.Desc's size and limits; a prepared launch's Desc holds the
    argument bytes and, per address slot, the places it fills; a bad call raises a Python error."""
    assert native.desc_size() == ctypes.sizeof(launch.Desc)
    assert native.limits() == (launch.MAX_PARAMS, launch.MAX_BYTES, launch.MAX_ADDRESSES, launch.MAX_FILLS)
    assert list(tmp_path.glob("fastlaunch-*"))  # built into the cache
    args = [(ctypes.c_uint64, 0), (ctypes.c_int32, 4096), (ctypes.c_uint64, 0), (ctypes.c_float, 0.5)]
    ln = launch.Launch(0xF00, (3, 1, 1), 128, 64, 1, args, [[(0, 0)], [(2, 0), (0, 0)], []])
    d = ln.desc
    assert (d.function, list(d.grid), d.block, d.smem, d.cluster, d.n_params) == (0xF00, [3, 1, 1], 128, 64, 1, 4)
    assert list(d.offsets[:4]) == [0, 8, 16, 24] and d.n_bytes == 28 and ln.n_slots == d.n_slots == 3
    assert d.n_fills == 3 and list(d.fill_offset[:3]) == [0, 16, 0] and list(d.fill_slot[:3]) == [0, 1, 1]
    raw = ctypes.string_at(ctypes.addressof(d) + launch.Desc.bytes.offset, d.n_bytes)
    assert raw == launch.pack(args)[0] and struct.unpack_from("<i", raw, 8) == (4096,)
    call = ln.call
    del ln, d
    gc.collect()
    assert call.desc.n_bytes == 28  # the call keeps its Desc alive: fastpath keeps only calls
    with pytest.raises(OverflowError):
        call(-1, 0, 0, 0)
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:  # no driver here: a well-formed call says so
        with pytest.raises(RuntimeError, match="libcuda"):
            call(0, 0, 0, 0)
    assert launch.problem([(ctypes.c_uint64, 0)] * 65, [])
    with pytest.raises(ValueError, match="Desc holds"):
        launch.Launch(0xF00, (1, 1, 1), 32, 0, 1, [(ctypes.c_uint64, 0)] * 65)
    assert launch.problem(args, [[(0, 0)]] * (launch.MAX_ADDRESSES + 1))  # more addresses than MAX_ADDRESSES
    assert launch.problem(args, [[(0, 0)] * 33])  # more places than MAX_FILLS
    assert launch.problem(args, [[(1, 0)]])  # 8 bytes do not fit in an int32 parameter
    assert launch.problem(args, [[(4, 0)]])  # no such parameter


@needs_cc
def test_address_count_is_checked_before_the_driver(native):
    """A call with more or fewer addresses than its Desc has slots raises a TypeError naming both counts,
    before the driver is touched (without libcuda, a call that got that far would raise RuntimeError)."""
    ln = launch.Launch(0xF00, (1, 1, 1), 32, 0, 1, [(ctypes.c_uint64, 0), (ctypes.c_uint64, 0)], [[(0, 0)], [(1, 0)]])
    for addresses in ((), (1,), (1, 2, 3)):
        with pytest.raises(TypeError, match=f"takes 2 addresses, got {len(addresses)}"):
            ln.call(0, *addresses)
    with pytest.raises(TypeError, match="at least"):
        native.launch(ctypes.addressof(ln.desc))
    with pytest.raises(ValueError, match="not a prepared Desc"):
        native.launch(0, 0)


@needs_cc
def test_regroup_merges_slots_and_nulls_the_rest(native):
    """Launch.regroup: new slots filling the places of several old ones, in the order given; an old slot in
    no group leaves null bytes in its places; the rest of the bytes unchanged."""
    args = [(ctypes.c_uint64, 0x11), (ctypes.c_uint64, 0x22), (ctypes.c_int32, 7), (ctypes.c_uint64, 0x33)]
    ln = launch.Launch(0xF00, (2, 1, 1), 64, 0, 1, args, [[(0, 0)], [(1, 0)], [(3, 0)]])
    r = ln.regroup([[2, 0], [], [1]])  # new slot 0: old 2 and 0; 1: none; 2: old 1
    assert r.fills == [[24, 0], [], [8]] and r.desc.n_slots == 3 and r.desc.n_fills == 3
    assert list(r.desc.fill_offset[:3]) == [24, 0, 8] and list(r.desc.fill_slot[:3]) == [0, 0, 2]
    dropped = ln.regroup([[0], [2]])
    raw = ctypes.string_at(ctypes.addressof(dropped.desc) + launch.Desc.bytes.offset, dropped.desc.n_bytes)
    assert struct.unpack_from("<QQiiQ", raw) == (0x11, 0, 7, 0, 0x33)  # old slot 1 (0x22) nulled
    assert ln.desc.n_slots == 3  # the original is untouched


# ---- fastlaunch.c's build and the cache -------------------------------------------------------------------


@needs_cc
def test_load_native_takes_the_cache_without_a_compiler(tmp_path, monkeypatch):
    """A verified cache entry is loaded with no C compiler at all ($CC a compiler that does not exist, no cc
    on PATH); without the entry, the build fails with errors.BackendFailed naming the missing compiler, and
    every later launch says the same."""
    monkeypatch.setenv("FASTSOFTMAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(launch, "_native_mod", [])
    assert launch._load_native().desc_size() == ctypes.sizeof(launch.Desc)  # built and stored
    assert (tmp_path / launch.native_entry()).exists()
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PATH", str(empty))
    assert launch.compiler()[0] is None
    mod = launch._load_native()
    assert mod.desc_size() == ctypes.sizeof(launch.Desc)
    (tmp_path / launch.native_entry()).unlink()
    with pytest.raises(BackendFailed, match="C compiler"):
        launch._load_native()
    monkeypatch.setattr(launch, "_native_mod", [])
    for _ in range(2):
        with pytest.raises(BackendFailed, match="C compiler"):
            launch.Launch(0xF00, (1, 1, 1), 32, 0, 1, [(ctypes.c_uint64, 0)], [[(0, 0)]])
    assert launch.describe().startswith("unavailable") and "C compiler" in launch.describe()


def test_info_says_how_kernels_and_replays_launch(monkeypatch):
    """fs.info()['replay']: fastlaunch.c's state, and how it reaches torch (C++ or Python's calls)."""
    import fastsoftmax as fs

    monkeypatch.setattr(launch, "_native_mod", [])
    assert fs.info()["replay"] == "fastlaunch.c (built on first launch)" and launch._native_mod == []
    monkeypatch.setattr(launch, "_native_mod", [BackendFailed("no C compiler")])
    assert fs.info()["replay"] == "unavailable (no C compiler)"
    monkeypatch.setattr(launch, "_native_mod", [object()])
    for name in ("_calls", "_build"):
        monkeypatch.setattr(torch_build, name, [])
    assert fs.info()["replay"] == "fastlaunch.c, torch reached through not asked yet"
    monkeypatch.setattr(torch_build, "_build", [object()])
    assert fs.info()["replay"].endswith("torch reached through Python's calls until fastlaunch_torch.cpp is built")
    monkeypatch.setattr(torch_build, "_calls", [BackendFailed("no C++ compiler")])
    assert fs.info()["replay"] == "fastlaunch.c, torch reached through Python's calls (no C++ compiler)"
    monkeypatch.setattr(torch_build, "_calls", [object()])
    assert fs.info()["replay"] == "fastlaunch.c, torch reached through fastlaunch_torch.cpp"
    monkeypatch.setattr(fastpath, "ENABLED", False)
    assert fs.info()["replay"] == "off (FASTSOFTMAX_FAST_LAUNCH=0)"


def test_torch_calls_build_in_the_background(tmp_path, monkeypatch):
    """fastlaunch_torch.cpp: a cached build loads at once; otherwise a thread waits for the detached build
    (the caller not waiting: None, and fs.info() says so), ``ready`` called with the table from that thread
    once it is loaded, a later call waiting for it; a failed build leaves None and says why, calling nobody;
    a recorded failure is not retried."""
    import threading

    from fastsoftmax import cache

    monkeypatch.setenv("FASTSOFTMAX_CACHE_DIR", str(tmp_path))
    gate, table, seen, spawned = threading.Event(), object(), [], []

    def fresh(load):
        for name in ("_calls", "_build", "_ready"):
            monkeypatch.setattr(torch_build, name, [])
        monkeypatch.setattr(torch_build, "_load", load)

    monkeypatch.setattr(torch_build, "_spawn_build", lambda: spawned.append(gate.wait(10)))
    fresh(lambda: table)
    ready = lambda t: seen.append((t, threading.current_thread().name))  # noqa: E731
    assert torch_build.torch_calls(wait=False, ready=ready) is None
    assert torch_build.describe() == "Python's calls until fastlaunch_torch.cpp is built"
    assert torch_build._build[0].daemon
    gate.set()
    assert torch_build.torch_calls() is table and seen == [(table, "fastsoftmax-build")] and spawned == [True]
    assert torch_build.describe() == "fastlaunch_torch.cpp"
    # a failed build: None, why, and no callback
    fresh(lambda: BackendFailed("no C++ compiler"))
    assert torch_build.torch_calls(ready=seen.append) is None and len(seen) == 1
    assert torch_build.describe() == "Python's calls (no C++ compiler)"
    # a cached build: loaded on the calling thread, no thread started
    fresh(lambda: table)
    cache.store(torch_build._entry(), b"built")
    assert torch_build.torch_calls(wait=False) is table and torch_build._build == []
    # a recorded failure: not built again
    fresh(lambda: pytest.fail("built again"))
    cache.forget(torch_build._entry())
    cache.store(torch_build._entry() + ".failed", b"it did not compile")
    assert torch_build.torch_calls() is None and torch_build.describe() == "Python's calls (it did not compile)"


@needs_cc
def test_torch_calls_failed_build_is_recorded_once(tmp_path):
    """The real detached build with no C++ compiler ($CXX names none), in a fresh process: the call answers
    (torch reached through Python), the failure is stored beside the entry's name and says why, and the
    next process does not try again (it finds the record)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, FASTSOFTMAX_CACHE_DIR=str(tmp_path), CXX="/nonexistent/c++")
    code = (
        "import torch, fastsoftmax as fs\n"
        "from fastsoftmax import torch_build\n"
        "x = torch.randn(3, 5)\n"
        "assert torch.equal(fs.softmax(x), torch.softmax(x, -1))\n"
        "assert torch_build.torch_calls() is None\n"
        "print(fs.info()['replay'])\n"
    )
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "torch reached through Python's calls (no C++ compiler" in out.stdout, out.stdout
    failed = [p.name for p in tmp_path.iterdir() if p.name.endswith(".failed")]
    assert len(failed) == 1 and failed[0].startswith("fastlaunch_torch-")


# ---- Triton kernels: their signatures packed into a Launch (triton/launch.py) ----------------------------


def _fake_ck(signature, **meta):
    """A CompiledKernel as triton/launch.py reads it: metadata, src.signature, the loaded function."""
    md = (
        dict(
            num_warps=4,
            shared=128,
            num_ctas=1,
            launch_pdl=False,
            launch_cooperative_grid=False,
            global_scratch_size=0,
            global_scratch_align=1,
            profile_scratch_size=0,
            profile_scratch_align=1,
            name="k",
        )
        | meta
    )
    md = SimpleNamespace(**{k: v for k, v in md.items() if v is not ...})
    return SimpleNamespace(metadata=md, src=SimpleNamespace(signature=signature), function=0xABC, name="k")


SIG = {
    "x": "*bf16",
    "y": "*bf16",
    "n": "i32",
    "BLOCK": "constexpr",
    "scale": "fp32",
    "flag": "i1",
    "g": "i8",
    "w": "*fp32",
    "big": "i64",
    "u": "u64",
    "h": "i16",
    "v": "u8",
    "f64": "fp64",
}


@needs_cc
def test_triton_signature_packed_into_launch_params(native):
    """A Triton launch as Triton's launcher passes it: constexprs dropped, pointers as 8-byte address slots
    (one per pointer argument, in order), integers and floats by their types (narrower integers in 32-bit
    storage, sign- or zero-extended), the global and profile scratch pointers last (null); block = 32 x
    num_warps, the kernel's shared memory, the grid padded to three dims."""
    from fastsoftmax.kernels.triton.launch import KernelPlan

    plan = KernelPlan(_fake_ck(SIG), list(SIG), [None] * len(SIG))
    assert [n for _, n, _ in plan.runtime] == [n for n in SIG if n != "BLOCK"] and plan.trailing == 2
    values = [0, 0, 4096, 0.5, True, -2, 0, -3, 2**64 - 1, -5, 200, 0.25]
    ln = plan.launch((3, 2), values)
    d = ln.desc
    assert (d.function, list(d.grid), d.block, d.smem, d.cluster) == (0xABC, [3, 2, 1], 128, 128, 1)
    assert d.n_params == 14 and list(d.offsets[:14]) == [0, 8, 16, 20, 24, 28, 32, 40, 48, 56, 60, 64, 72, 80]
    assert ln.fills == [[0], [8], [32]] and d.n_bytes == 88
    raw = ctypes.string_at(ctypes.addressof(d) + launch.Desc.bytes.offset, d.n_bytes)
    assert struct.unpack_from("<ifii", raw, 16) == (4096, 0.5, 1, -2)
    assert struct.unpack_from("<QqQiIdQQ", raw, 32) == (0, -3, 2**64 - 1, -5, 200, 0.25, 0, 0)
    # Triton before 3.5 appends no profile scratch pointer, before 3.2 no global scratch pointer either
    old = KernelPlan(_fake_ck(SIG, profile_scratch_size=..., profile_scratch_align=...), list(SIG), [None] * 13)
    assert old.trailing == 1 and old.launch((1,), values).desc.n_params == 13
    older = KernelPlan(_fake_ck(SIG, profile_scratch_size=..., global_scratch_size=...), list(SIG), [None] * 13)
    assert older.trailing == 0


@needs_cc
def test_triton_kernels_launch_cannot_make_are_refused(native):
    """What launch.py does not make raises errors.BackendFailed at the first launch, naming it."""
    from fastsoftmax.kernels.triton.launch import KernelPlan

    cases = [
        (_fake_ck(SIG, global_scratch_size=256), "global or profile scratch"),
        (_fake_ck(SIG, profile_scratch_size=64), "global or profile scratch"),
        (_fake_ck(SIG, num_ctas=2), "num_ctas > 1"),
        (_fake_ck(SIG, num_ctas=..., cluster_dims=(2, 1, 1)), "num_ctas > 1"),
        (_fake_ck(SIG, launch_cooperative_grid=True), "cooperative grid"),
        (_fake_ck(SIG, launch_pdl=True), "programmatic dependent launch"),
        (_fake_ck(SIG, tensordesc_meta=[{"swizzle": 128}]), "TMA descriptors"),
        (_fake_ck({**SIG, "t": "tensordesc<bf16[64, 64]>"}), "TMA descriptors"),
        (_fake_ck(SIG, instrumentation_mode="gsan"), "GSan"),
        (_fake_ck(SIG, shared=300 * 1024), "oversized shared memory"),
        (_fake_ck({**SIG, "t": ("i32", "i32")}), "tuple argument"),
        (_fake_ck({**SIG, "t": "fp16"}), "of type fp16"),
        (_fake_ck({**SIG, **{f"p{i}": "*fp32" for i in range(launch.MAX_ADDRESSES)}}), "more arguments than a"),
    ]
    for ck, why in cases:
        names = list(ck.src.signature)
        with pytest.raises(BackendFailed, match=why):
            KernelPlan(ck, names, [None] * len(names))
    with pytest.raises(BackendFailed, match="not one type per argument"):
        KernelPlan(_fake_ck(SIG), [*SIG, "extra"], [None] * 14)


def test_the_interpreter_keeps_tritons_own_launch(monkeypatch, device):
    """CPU tensors (Triton's interpreter): kernel[grid](...) runs, never a prepared launch."""
    import fastsoftmax as fs

    if device != "cpu":
        pytest.skip("the Triton kernels are compiled, not interpreted, under --device cuda")

    def refuse(*a, **k):
        raise AssertionError("a prepared launch under the interpreter")

    monkeypatch.setattr(launch, "submit", refuse)
    monkeypatch.setattr(launch.Launch, "__init__", refuse)
    x = torch.randn(4, 40)
    torch.testing.assert_close(fs.softmax(x, backend="triton"), torch.softmax(x, -1))


class _FakeTensor:
    """A CUDA tensor as triton/launch.py reads one (no GPU here)."""

    is_cuda = True

    def __init__(self, address):
        self.address = address

    def data_ptr(self):
        return self.address

    def get_device(self):
        return 0


class _FakeKernel:
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


class _HashableCk(SimpleNamespace):
    __hash__ = object.__hash__
    __eq__ = object.__eq__


@needs_cc
def test_triton_full_path_launches_a_cached_launch(native, monkeypatch):
    """triton/launch.launch on CUDA tensors: the compiled kernel from run(warmup=True), its runtime values
    from the positional arguments, the keywords and the defaults, one Launch per (kernel, grid, non-pointer
    values) reused, the pointers' addresses submitted on torch's current stream; with a launch hook
    registered, kernel[grid](...) instead, and the recording marked not replayable."""
    from fastsoftmax.kernels.triton import launch as tl

    sig = {"x": "*fp32", "y": "*fp32", "n": "i32", "scale": "fp32", "BLOCK": "constexpr", "tail": "i32"}
    ck = _HashableCk(**vars(_fake_ck(sig)))
    kernel = _FakeKernel(ck, list(sig), [None] * 5 + [7])
    submitted = []
    monkeypatch.setattr(launch, "submit", lambda ln, stream, values, *_: submitted.append((ln, stream, values)))
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0x5EED, raising=False)
    monkeypatch.setattr(tl, "_plans", {})
    monkeypatch.setattr(launch, "_launches", {})
    x, y = _FakeTensor(0x1000), _FakeTensor(0x2000)
    tl.launch(kernel, (4,), (x, y, 100), dict(scale=0.5, BLOCK=128, num_warps=4))
    tl.launch(kernel, (4,), (x, y, 100), dict(scale=0.5, BLOCK=128, num_warps=4))
    tl.launch(kernel, (4,), (x, y, 100), dict(scale=-0.0, BLOCK=128, num_warps=4))
    tl.launch(kernel, (4,), (x, y, 100), dict(scale=0.0, BLOCK=128, num_warps=4, tail=9))
    (a, s1, v1), (b, _, v2), (c, _, _), (d, _, _) = submitted
    assert a is b and len({id(a), id(c), id(d)}) == 3 and s1 == 0x5EED and v1 == [x, y] == v2
    raw = ctypes.string_at(ctypes.addressof(a.desc) + launch.Desc.bytes.offset, a.desc.n_bytes)
    assert struct.unpack_from("<QQifi4xQQ", raw) == (0, 0, 100, 0.5, 7, 0, 0) and a.fills == [[0], [8]]
    raw = ctypes.string_at(ctypes.addressof(d.desc) + launch.Desc.bytes.offset, d.desc.n_bytes)
    assert struct.unpack_from("<ifi", raw, 16) == (100, 0.0, 9) and list(a.desc.grid) == [4, 1, 1]
    assert kernel.runs[0] == ((x, y, 100), dict(scale=0.5, BLOCK=128, num_warps=4)) and not kernel.launched
    monkeypatch.setattr(launch, "hooks_idle", lambda: False)
    rec = launch.start()
    tl.launch(kernel, (4,), (x, y, 100), dict(scale=0.5, BLOCK=128, num_warps=4))
    assert kernel.launched == [((4,), (x, y, 100), dict(scale=0.5, BLOCK=128, num_warps=4))] and len(submitted) == 4
    assert not rec.ok
    launch.abort()


# ---- the recording, mapped to roles (fastpath.finish) ------------------------------------------------------


def _ptrs(n: int):
    return [(ctypes.c_uint64, 0)] * n


@needs_cc
def test_finish_maps_recorded_slots_to_roles(native, monkeypatch):
    """finish(): every slot's tensor (or address) given a role, x, y, dy or a workspace marked by scratch();
    each recorded Launch regrouped to the replay's four slots (x, y, dy, workspace), null addresses left
    out; anything else (an unknown tensor, a dtype view, an unrecorded launch, two workspaces in one launch)
    stores no replay."""
    built = []
    monkeypatch.setattr(fastpath, "_make_replay", lambda steps, plan, out_dtype: built.append(steps) or "entry")
    fastpath.clear()
    x, y, d = torch.randn(4, 8), torch.empty(4, 8), torch.randn(4, 8)
    heuristics.record(heuristics.Plan("triton", "split"))

    def record(k, launches, dy=None, ws=None, ok=True):
        rec = fastpath.start(k)
        assert rec is not None and launch.recording() is rec
        if ws is not None:
            assert launch.scratch(ws) is ws
        for ln, values in launches:
            ln.call = lambda *a: 0  # no driver here: a launch that "succeeds"
            launch.submit(ln, 0, values, 0, "test")
        if not ok:
            launch.unrecorded()
        fastpath.finish(rec, k, x, dy, y, None)
        assert launch.recording() is None

    tri = launch.Launch(0xA, (1, 1, 1), 128, 0, 1, _ptrs(5), [[(i, 0)] for i in range(5)])
    ws = torch.empty(16)
    # a Triton-like launch: x, y, y as the unused lse, x as the unused mask, the workspace
    record("k1", [(tri, (x, y, y, x, ws))], ws=ws)
    ((step,),) = built
    ln, role = step
    assert role == ("scratch", 0, 16, torch.float32) and fastpath._cache["k1"] == "entry"
    assert ln.fills == [[0, 24], [8, 16], [], [32]] and ln.desc.n_slots == 4
    # the CUDA backend's struct: integer addresses, null ones left out
    cu = launch.Launch(
        0xB,
        (2, 1, 1),
        64,
        0,
        1,
        [(_Params, _Params())],
        [[(0, getattr(_Params, f).offset)] for f in ("x", "y", "d", "lse")],
    )
    record("k2", [(cu, (x.data_ptr(), y.data_ptr(), d.data_ptr(), 0))], dy=d)
    ((ln, role),) = built[-1]
    assert role is None and ln.fills == [[0], [8], [16], []]
    # two launches sharing one workspace (the split path)
    record("k3", [(tri, (x, ws, x, x, ws)), (tri, (x, y, y, x, ws))], ws=ws)
    assert [r for _, r in built[-1]] == [("scratch", 0, 16, torch.float32)] * 2
    n = len(built)
    record("k4", [(tri, (x, y, y, torch.empty(3), ws))], ws=ws)  # a tensor made during the call
    record("k5", [(tri, (x, y, y, x.view(torch.int32), ws))], ws=ws)  # x, as another dtype
    record("k6", [(tri, (x, y, y, x, ws))], ws=ws, ok=False)  # a launch not through submit
    other = torch.empty(8)
    rec = fastpath.start("k7")
    launch.scratch(ws), launch.scratch(other)
    tri.call = lambda *a: 0
    launch.submit(tri, 0, (x, y, y, other, ws), 0, "test")
    fastpath.finish(rec, "k7", x, None, y, None)  # two workspaces in one launch
    assert len(built) == n and set(fastpath._cache) == {"k1", "k2", "k3"}
    fastpath.clear()


def test_start_gates_the_recording(monkeypatch):
    """No recording without a key, under heuristics.force, or with the replay cache full; abort() ends one."""
    assert fastpath.start(None) is None
    with heuristics.force(path="online"):
        assert fastpath.start("k") is None
    monkeypatch.setattr(fastpath, "MAX_ENTRIES", 0)
    assert fastpath.start("k") is None
    monkeypatch.setattr(fastpath, "MAX_ENTRIES", 4096)
    assert fastpath.start("k") is launch.recording() is not None
    fastpath.abort()
    assert launch.recording() is None and launch.scratch(torch.empty(1)) is not None


_COMPILED_PARAMS = r"""
import re, sys
import torch, triton
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
    backend = make_backend(GPUTarget("cuda", 90, 32))
except Exception as e:  # Triton's internals used here moved: nothing to check against
    print("SKIP", repr(e)); sys.exit(0)
from fastsoftmax import heuristics
from fastsoftmax.kernels.triton import launch as tlaunch, softmax_bwd, softmax_fwd

captured = []
softmax_fwd.launch = softmax_bwd.launch = lambda *a: captured.append(a)
for shape, path in (((64, 1000), "rowblock"), ((64, 50257), "online"), ((8, 65536), "split")):
    x = torch.randn(shape, dtype=torch.bfloat16); y = torch.empty_like(x)
    with heuristics.force(path=path):
        softmax_fwd.forward(x, y, 1, False, False)
        softmax_bwd.backward(torch.randn_like(x), y, torch.empty_like(x), 1, True)
size = {"u64": 8, "b64": 8, "s64": 8, "f64": 8, "u32": 4, "b32": 4, "s32": 4, "f32": 4, "u16": 2, "b16": 2,
        "s16": 2, "u8": 1, "b8": 1, "s8": 1}
for kernel, grid, args, kwargs in captured:
    try:  # the JIT's own binder and signature, as kernel[grid](...) makes them, without a GPU
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
        ck = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=backend.target,
                            options=options.__dict__)
    except Exception as e:
        print("SKIP", repr(e)); sys.exit(0)
    ck.function = 1  # (what _init_handles would load on a GPU)
    plan = tlaunch.KernelPlan(ck, kernel.arg_names, [None] * len(kernel.arg_names))
    values = [args[i] if i < len(args) else kwargs[name] for i, name, _ in plan.runtime]
    params, slots = plan.params(values)
    declared = re.findall(r"\.param\s+\.([a-z0-9]+)(?:\s+\.ptr[^,\n]*?)?\s+\w+_param_\d+", ck.asm["ptx"])
    ours = [tlaunch.ctypes.sizeof(t) for t, _ in params]
    assert len(declared) == len(ours), (kernel.fn.__name__, declared, ours)
    assert all(o >= size[d] for d, o in zip(declared, ours)), (kernel.fn.__name__, declared, ours)
    assert all(declared[i] == "u64" for (i, _), in slots), (kernel.fn.__name__, declared, slots)
    assert plan.block == 32 * ck.metadata.num_warps and plan.smem == ck.metadata.shared
print("OK", len(captured))
"""


def test_compiled_kernels_take_the_parameters_packed():
    """fastsoftmax's Triton kernels compiled for sm_90 by the installed Triton (its own binder and compiler,
    no GPU needed): each launch's packed parameter list has the compiled kernel's parameter count (the
    runtime arguments, then Triton's global and profile scratch pointers), each parameter's storage at
    least as wide as the PTX declares it, and 64-bit parameters at the address slots."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = str(Path(__file__).parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", _COMPILED_PARAMS], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    if out.stdout.startswith("SKIP"):
        pytest.skip(f"this Triton's compiler or binder cannot be driven without a GPU: {out.stdout.strip()}")
    assert out.stdout.strip() == "OK 8", out.stdout


# ---- the replay's hot path in C (fastlaunch.c: softmax_key, softmax_fast, loss_key, launch_steps) --------


@pytest.fixture
def hot(native, monkeypatch):
    """fastlaunch configured for the replay (fastpath._native), the module's globals restored afterwards."""
    monkeypatch.setattr(fastpath, "_native_mod", [])
    monkeypatch.setattr(fastpath, "fast", fastpath.fast)
    monkeypatch.setattr(fastpath, "loss_key", fastpath.loss_key)
    monkeypatch.setattr(fastpath, "loss_cpu", fastpath.loss_cpu)
    mod = fastpath._native()
    assert mod is native and fastpath.fast is native.softmax_fast and fastpath.loss_key is native.loss_key
    return native


def _softmax_key(x, d, dim, dtype, log, backend):
    """fastpath's softmax key as Python would build it (the tuple the C key must equal)."""
    px = x.data_ptr()
    k = (x.shape, x.stride(), x.dtype, x.get_device(), px % 16, dim, dtype, log, backend)
    if d is not None:
        pd = d.data_ptr()
        k += (d.stride(), d.dtype, pd % 16, (pd - px) % 16, d.shape, d.get_device())
    return k


@pytest.fixture
def python_calls(hot, monkeypatch):
    """hot, reaching torch through Python's calls (as where fastlaunch_torch.cpp cannot be built: no row
    kernels either); the table restored afterwards."""
    monkeypatch.setattr(torch_build, "row_kernels", lambda: None)
    hot.configure_torch(None)
    fastpath.clear()
    yield hot
    hot.configure_torch(torch_build.torch_calls())
    fastpath.clear()


def _unkeyed(hot, x):
    """The arguments no key is made of, in either form; None asserted for each."""
    for args in (
        (x, None, 1.0, None, False, "auto"),
        (x, None, True, None, False, "auto"),  # (a bool is not an int here, as type(dim) is int)
        (x, None, -1, "float32", False, "auto"),
        (x, None, -1, None, False, None),
        (torch.nn.Parameter(x), None, -1, None, False, "auto"),
        (x, [1.0], -1, None, False, "auto"),
        ([1.0], None, -1, None, False, "auto"),
    ):
        assert hot.softmax_key(*args, False) is None, args
    empty = torch.randn(4, 8)
    empty.untyped_storage().resize_(0)
    assert hot.softmax_key(empty, None, -1, None, False, "auto", False) is None


@needs_cc
def test_native_softmax_key_is_the_tuple(python_calls):
    """Through Python's calls, softmax_key builds the very tuple the recording stores (shape, strides, dtype,
    device, address mod 16, dim, output dtype, log, backend; and dy's), for layouts and addresses of every
    kind; None for what the replay never keys (a non-int dim, a dtype that is not one, a backend that is not
    a str, a Parameter or a list, no storage, and CPU tensors unless asked)."""
    hot = python_calls
    base = torch.randn(6, 40)
    cases = [
        (base, None, -1, None, False),
        (base.t(), None, 0, torch.float32, True),
        (base[:, 1:33], base[:, 3:35], 1, None, False),  # misaligned, dy at another offset
        (base.to(torch.bfloat16)[1:], None, -1, torch.float32, False),
        (base.view(6, 5, 8).transpose(1, 2), base.view(6, 5, 8).transpose(1, 2).contiguous(), 1, None, True),
        (torch.randn(()), None, 0, None, False),
    ]
    for x, d, dim, dtype, log in cases:
        got = hot.softmax_key(x, d, dim, dtype, log, "auto", False)
        assert got == _softmax_key(x, d, dim, dtype, log, "auto"), (x.shape, x.stride())
        assert hash(got) == hash(_softmax_key(x, d, dim, dtype, log, "auto"))
        assert hot.softmax_key(x, d, dim, dtype, log, "auto") is None  # CPU tensors: no replay
    x = base
    _unkeyed(hot, x)
    # a CPU tensor: nothing replayed, the CPU's direct path (equal to the Python path's)
    assert torch.equal(hot.softmax_fast(x, None, -1, None, False, "auto"), native_softmax(x, 1, False, x.dtype))
    assert hot.softmax_fast(x, None, -1, None, False, "torch") is None  # (only backend='auto' takes it)


@needs_cc
def test_native_packed_key_tells_calls_apart(hot):
    """Through fastlaunch_torch.cpp (torch's calls in C++) the key is packed bytes: equal for calls alike in
    every keyed field (another tensor of the same layout and alignment, a view 16 bytes on), different when
    any one field differs (shape, strides, dtype, address mod 16, dim, output dtype, log, backend; dy's
    strides, dtype, address, shape); None where the tuple is None, for a backend that is not one, past 8 dims
    and for a lazily negated tensor."""
    if torch_build.torch_calls() is None:
        pytest.fail(f"fastlaunch_torch.cpp did not build here (the CI has a C++ compiler): {torch_build.describe()}")

    def k(x, d=None, dim=-1, dtype=None, log=False, backend="auto"):
        return hot.softmax_key(x, d, dim, dtype, log, backend, False)

    buf, flat = torch.randn(9 * 48), torch.randn(9 * 48)
    base, other = buf[:384].view(8, 48), flat[:384].view(8, 48)
    ref = k(base)
    assert isinstance(ref, bytes) and k(other) == ref and k(buf[4:388].view(8, 48)) == ref
    keys = [
        ref,
        k(base[:4]),
        k(base.t().contiguous().t()),
        k(base.double()),
        k(buf[1:385].view(8, 48)),
        k(base, dim=1),
        k(base, dim=0),
        k(base, dtype=torch.float64),
        k(base, log=True),
        k(base, backend="triton"),
        k(base, other),
        k(base, other.t().contiguous().t()),
        k(base, other.double()),
        k(base, flat[1:385].view(8, 48)),
        k(base, flat[:384].view(4, 96)),
    ]
    assert None not in keys and len(set(keys)) == len(keys)
    assert k(base, other) == k(base, torch.randn(8, 48)) and k(base, other) != k(other, base.t())
    # the most dims a key packs (8, with an 8-dim dy: 45 entries of 8 bytes); 9 dims: no key; a lazy
    # negation (its memory is not its value): no key
    x8, d8 = torch.randn((2,) * 8), torch.randn((2,) * 8)
    assert len(k(x8, d8)) == 8 * (2 * (1 + 2 * 8 + 3) + 1 + 4) and len(k(x8)) == 8 * (1 + 2 * 8 + 3 + 4)
    assert k(torch.randn((2,) * 9)) is None and k(torch._neg_view(base)) is None
    _unkeyed(hot, base)
    assert k(base, backend="fast") is None and k(base, log=1) is None
    assert hot.softmax_key(base, None, -1, None, False, "auto") is None  # CPU tensors: no replay
    want = native_softmax(base, 1, False, base.dtype)
    assert torch.equal(hot.softmax_fast(base, None, -1, None, False, "auto"), want)


def _loss_key_steps_aside(hot, x, t, opts):
    """loss_key's None for what the replay never takes (class weights, strided logits or targets, fp64 or
    empty logits, options of other types) and while anything but a plain eager call may be under way: a
    torch.func transform, a forward-mode AD level, a dispatch mode, autocast, heuristics.force, a Triton
    launch hook; the key unchanged afterwards."""
    import torch.autograd.forward_ad as fwad

    def key(x=x, t=t, w=None, opts=opts):
        return hot.loss_key(x, t, w, *opts, False)

    want = key()
    assert want is not None
    for bad in (
        dict(w=torch.ones(40)),
        dict(x=torch.randn(40, 6).t()),
        dict(t=torch.randint(0, 40, (12,))[::2]),
        dict(x=x.double()),
        dict(x=torch.randn(0, 40), t=t[:0]),
        dict(opts=(-100.0, *opts[1:])),
        dict(opts=(-100, "mean", torch.tensor(0.1), *opts[3:])),
        dict(opts=(*opts[:3], "30", *opts[4:])),
        dict(opts=(*opts[:5], 1, "auto")),
        dict(opts=(*opts[:6], None)),
    ):
        assert key(**bad) is None, bad

    seen = []
    torch.func.vmap(lambda r: seen.append(key()) or r)(torch.randn(2, 3))
    with fwad.dual_level():
        seen.append(key())
    with pass_through_mode():
        seen.append(key())
    with torch.autocast("cpu"):
        seen.append(key())
    with heuristics.force(path="online"):
        seen.append(key())
    assert seen == [None] * 5, seen
    from triton import knobs

    hook = lambda *a: None  # noqa: E731
    with triton_hook(knobs.runtime, "launch_exit_hook", hook):
        assert key() is None
    assert key() == want


@needs_cc
def test_native_loss_key_is_the_tuple_and_steps_aside(python_calls):
    """Through Python's calls, loss_key is the tuple the cross-entropy recording stores, whether the logits
    need a gradient included; None for what the replay never takes (_loss_key_steps_aside)."""
    hot = python_calls
    x, t = torch.randn(6, 40), torch.randint(0, 40, (6,), dtype=torch.int32)
    opts = (-100, "mean", 0.1, None, 0.0, False, "auto")

    def key(x=x, t=t, w=None, opts=opts):
        return hot.loss_key(x, t, w, *opts, False)

    px, pt = x.data_ptr(), t.data_ptr()
    want = (x.shape, x.dtype, -1, px % 16, t.shape, t.dtype, pt % 16, False, *opts[:6], "auto", -1)
    assert key() == want
    xg = x.clone().requires_grad_()
    assert key(xg)[7] is True
    with torch.no_grad():
        assert key(xg)[7] is False
    assert key(opts=(-100, "sum", 0, 30.0, 1e-4, True, "triton"))[9:15] == ("sum", 0, 30.0, 1e-4, True, "triton")
    assert hot.loss_key(x, t, None, *opts) is None  # CPU tensors: no replay
    _loss_key_steps_aside(hot, x, t, opts)


@needs_cc
def test_native_packed_loss_key(hot):
    """Through fastlaunch_torch.cpp, loss_key's tuple holds the logits' and targets' dims packed and their
    dtypes as numbers, the rest as the tuple's (the replay reads the device, the gradient flag and the
    options by position): equal for calls alike, different when a shape, dtype, alignment or option
    differs; None as the tuple's (_loss_key_steps_aside)."""
    if torch_build.torch_calls() is None:
        pytest.fail(f"fastlaunch_torch.cpp did not build here (the CI has a C++ compiler): {torch_build.describe()}")
    buf, tb = torch.randn(7 * 40), torch.randint(0, 40, (12,), dtype=torch.int32)
    x, t = buf[:240].view(6, 40), tb[:6]
    opts = (-100, "mean", 0.1, None, 0.0, False, "auto")

    def key(x=x, t=t, opts=opts):
        return hot.loss_key(x, t, None, *opts, False)

    want = key()
    assert isinstance(want[0], bytes) and want[2] == -1 and want[7] is False and want[8:15] == opts
    assert key(buf[4:244].view(6, 40), tb[4:10]) == want
    xg = x.clone().requires_grad_()
    assert key(xg)[7] is True
    with torch.no_grad():
        assert key(xg)[7] is False
    keys = [
        want,
        key(buf[:200].view(5, 40), tb[:5]),
        key(buf[:240].view(2, 3, 40), tb[:6].view(2, 3)),
        key(x.bfloat16()),
        key(t=t.long()),
        key(buf[1:241].view(6, 40)),
        key(t=tb[1:7]),
        key(opts=(-1, *opts[1:])),
        key(opts=(*opts[:6], "triton")),
    ]
    assert None not in keys and len(set(keys)) == len(keys)
    assert hot.loss_key(x, t, None, *opts) is None  # CPU tensors: no replay
    _loss_key_steps_aside(hot, x, t, opts)


@needs_cc
@pytest.mark.parametrize("reach", ["torch_in_cpp", "torch_via_python"])
def test_native_tensor_key(hot, reach):
    """tensor_key (the cross-entropy backward's key of its upstream gradient): packed bytes through
    fastlaunch_torch, else the tuple (shape, strides, dtype, address mod 16); equal for tensors alike (and
    a view 16 bytes on), different for another shape, strides, dtype or alignment."""
    if reach == "torch_via_python":
        hot.configure_torch(None)
    elif torch_build.torch_calls() is None:
        pytest.fail(f"fastlaunch_torch.cpp did not build here (the CI has a C++ compiler): {torch_build.describe()}")
    try:
        buf = torch.randn(80)
        a = buf[:48].view(6, 8)
        key = hot.tensor_key(a)
        if reach == "torch_via_python":
            assert key == (a.shape, a.stride(), a.dtype, a.data_ptr() % 16)
        else:
            assert isinstance(key, bytes)
        assert hot.tensor_key(torch.randn(6, 8)) == key and hot.tensor_key(buf[4:52].view(6, 8)) == key
        keys = [key, hot.tensor_key(buf[:48].view(8, 6)), hot.tensor_key(a.t()), hot.tensor_key(a.double())]
        keys += [hot.tensor_key(buf[1:49].view(6, 8)), hot.tensor_key(torch.randn(()))]
        assert len(set(keys)) == len(keys)
    finally:
        hot.configure_torch(torch_build.torch_calls())


@needs_cc
def test_native_launch_steps_checks_its_steps(hot):
    """launch_steps: each step's (base, offset) pairs are its Desc's addresses (one pair per slot, base -1
    for null); a wrong count, an odd pair list or a base out of range raises before any launch; launches
    with nothing to run (an empty grid) return 0 without the driver."""
    ln = launch.Launch(0xF00, (0, 1, 1), 32, 0, 1, _ptrs(2), [[(0, 0)], [(1, 0)]])
    desc = ctypes.addressof(ln.desc)
    assert hot.launch_steps(0, ((desc, (0, 0, -1, 0)), (desc, (1, 64, 0, 16))), (4096, 8192)) == 0
    with pytest.raises(TypeError, match="takes 2 addresses, got 1"):
        hot.launch_steps(0, ((desc, (0, 0)),), (4096,))
    with pytest.raises(ValueError, match="pairs"):
        hot.launch_steps(0, ((desc, (0, 0, 1)),), (4096, 1))
    with pytest.raises(IndexError, match="base index"):
        hot.launch_steps(0, ((desc, (0, 0, 2, 0)),), (4096, 1))
    with pytest.raises(TypeError, match="a step is"):
        hot.launch_steps(0, ((desc,),), (4096,))


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
    for info in pkgutil.iter_modules(kernels.__path__):
        mod = importlib.import_module(f"fastsoftmax.kernels.triton.{info.name}")
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
