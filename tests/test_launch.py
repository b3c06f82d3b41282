"""launch.py and fastlaunch.c without a GPU: a kernel's argument bytes laid out as the C compiler lays out a
parameter list; fastlaunch.c built into a private cache, agreeing with launch.Desc and with cuda.h's driver
structures; a Launch's Desc and slots, regroup(), the calls fastlaunch refuses; retry() and the driver's
context, the recording, the launch cache. (triton/launch.py: test_triton_launch.py.)"""

import ctypes
import gc
import re
import shutil
import struct
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch
from helpers import triton_hook

from fastsoftmax import cache
from fastsoftmax.core.errors import BackendFailed
from fastsoftmax.info import replay as replay_line
from fastsoftmax.kernels import launch, replay

U64 = ctypes.c_uint64


def _can_build() -> bool:
    include = sysconfig.get_paths().get("include")
    return bool((shutil.which("cc") or shutil.which("gcc")) and include and Path(include, "Python.h").exists())


needs_cc = pytest.mark.skipif(not _can_build(), reason="no C compiler or Python headers here")


def _run_c(tmp_path, source: str, *flags) -> list[int]:
    """The numbers a C program prints, compiled here with the C compiler fastlaunch.c is built with."""
    src, exe = tmp_path / "prog.c", tmp_path / "prog"
    src.write_text(source)
    cc, _ = launch.compiler()
    subprocess.run([*cc, *flags, str(src), "-o", str(exe)], check=True, capture_output=True, timeout=60)
    return [int(v) for v in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()]


@pytest.fixture(scope="session")
def built_cache(tmp_path_factory):
    """A cache directory holding fastlaunch.c, built once for the session."""
    d = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FASTSOFTMAX_CACHE_DIR", str(d))
        mp.setattr(launch, "_native_mod", [])
        launch.native()
    return d


@pytest.fixture
def native(built_cache, monkeypatch):
    """fastlaunch loaded from the session's cache (its own _native_mod, restored afterwards)."""
    monkeypatch.setenv("FASTSOFTMAX_CACHE_DIR", str(built_cache))
    monkeypatch.setattr(launch, "_native_mod", [])
    return launch.native()


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """An empty private cache, and fastlaunch not yet loaded."""
    monkeypatch.setenv("FASTSOFTMAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(launch, "_native_mod", [])
    return tmp_path


def _bytes(ln) -> bytes:
    d = ln.desc
    return ctypes.string_at(ctypes.addressof(d) + launch.Desc.bytes.offset, d.n_bytes)


# ---- pack(): the parameter list's layout ------------------------------------------------------------------


class _Args(ctypes.Structure):  # a by-value struct with inner padding (as the CUDA backend's Params)
    _fields_ = [("x", ctypes.c_void_p), ("n", ctypes.c_int32), ("flag", ctypes.c_int8), ("big", ctypes.c_int64)]


class _Pair(ctypes.Structure):  # a struct aligned to 2
    _fields_ = [("a", ctypes.c_int16), ("b", ctypes.c_int8)]


_C = {U64: "uint64_t", ctypes.c_int64: "int64_t", ctypes.c_int32: "int32_t", ctypes.c_uint32: "uint32_t",
      ctypes.c_int16: "int16_t", ctypes.c_int8: "int8_t", ctypes.c_uint8: "uint8_t", ctypes.c_float: "float",
      ctypes.c_double: "double", ctypes.c_void_p: "void*", _Args: "struct Args", _Pair: "struct Pair"}  # fmt: skip


@needs_cc
def test_pack_lays_parameters_out_as_the_c_compiler_does(tmp_path):
    """Each parameter at the offset the C compiler gives it in a struct of the same members (the CUDA ABI's
    parameter list), its value's bytes there (a Structure copied whole); no parameters: 8 zero bytes."""
    params = [(U64, 7), (ctypes.c_int32, -3), (ctypes.c_float, 1.5), (ctypes.c_int8, -1), (U64, 2**64 - 1),
              (_Args, _Args(0x1000, 4097, 1, -2)), (ctypes.c_int16, -5), (_Pair, _Pair(3, 4)), (ctypes.c_double, 0.25),
              (ctypes.c_uint8, 200), (ctypes.c_int64, -(2**40))]  # fmt: skip
    raw, offsets = launch.pack(params)
    structs = "".join(
        f"struct {s.__name__[1:]} {{ {' '.join(f'{_C[t]} {n};' for n, t in s._fields_)} }};\n" for s in (_Args, _Pair)
    )
    members = " ".join(f"{_C[t]} p{i};" for i, (t, _) in enumerate(params))
    prints = " ".join(f'printf("%zu ", offsetof(struct P, p{i}));' for i in range(len(params)))
    src = f"#include <stdio.h>\n#include <stddef.h>\n#include <stdint.h>\n{structs}struct P {{ {members} }};\n"
    assert offsets == _run_c(tmp_path, src + f"int main(void) {{ {prints} return 0; }}\n")
    assert len(raw) == offsets[-1] + 8
    assert struct.unpack_from("<Qifb", raw, 0) == (7, -3, 1.5, -1) and struct.unpack_from("<Q", raw, 24) == (2**64 - 1,)
    assert raw[offsets[5] : offsets[5] + ctypes.sizeof(_Args)] == bytes(_Args(0x1000, 4097, 1, -2))
    assert struct.unpack_from("<h", raw, offsets[6]) == (-5,) and raw[offsets[7] : offsets[7] + 3] == b"\x03\x00\x04"
    assert struct.unpack_from("<d", raw, offsets[8]) == (0.25,) and raw[offsets[9]] == 200
    assert struct.unpack_from("<q", raw, offsets[10]) == (-(2**40),)
    assert launch.pack([]) == (bytes(8), [])


def test_problem_names_what_a_desc_cannot_hold():
    args = [(U64, 0), (ctypes.c_int32, 4096), (U64, 0), (ctypes.c_float, 0.5)]
    assert launch.problem(args, [[(0, 0)], [(2, 0), (0, 0)], []]) is None
    assert "65 parameters" in launch.problem([(U64, 0)] * 65, [])
    assert "of 1032 bytes" in launch.problem([(ctypes.c_char * 1032, b"")], [])
    assert "17 addresses" in launch.problem(args, [[(0, 0)]] * (launch.MAX_ADDRESSES + 1))
    assert "filling 33 places" in launch.problem(args, [[(0, 0)] * 33])
    for slot in ((1, 0), (4, 0), (-1, 0), (0, 1), (0, -1)):  # 8 bytes past an int32, no such parameter, ...
        assert "outside the parameter" in launch.problem(args, [[slot]]), slot
    assert launch.problem([(_Args, _Args())], [[(0, _Args.big.offset)]]) is None  # a slot inside a struct


# ---- fastlaunch.c: built, cached, agreeing with launch.Desc and cuda.h ------------------------------------


@needs_cc
def test_fastlaunch_builds_into_the_cache_and_agrees_with_desc(empty_cache):
    assert launch.describe() == "fastlaunch.c (built on first launch)"
    assert cache.load(launch.native_entry()) is None  # (describe() built nothing)
    mod = launch.native()
    assert launch.native() is mod and launch.describe() == "fastlaunch.c"
    assert cache.load(launch.native_entry())[:4] == b"\x7fELF"  # built into the private cache
    assert mod.desc_size() == ctypes.sizeof(launch.Desc)
    assert mod.limits() == (launch.MAX_PARAMS, launch.MAX_BYTES, launch.MAX_ADDRESSES, launch.MAX_FILLS)


@needs_cc
def test_driver_structures_are_laid_out_as_cuda_h_says(native, tmp_path):
    """fastlaunch.c's CUlaunchAttribute (the cluster dimension, its id) and CUlaunchConfig as cuda.h lays
    them out (Triton's copy of cuda.h, else a CUDA toolkit's), 64-bit."""
    import triton

    heads = [Path(triton.__file__).parent / "backends/nvidia/include", Path("/usr/local/cuda/include")]
    inc = next((d for d in heads if (d / "cuda.h").exists()), None)
    if inc is None:
        pytest.skip("no cuda.h here (neither Triton's nor a CUDA toolkit's)")
    src = """#include <stdio.h>
#include <stddef.h>
#include <cuda.h>
int main(void) {
    printf("%zu %zu ", sizeof(CUlaunchAttribute), offsetof(CUlaunchAttribute, value.clusterDim.x));
    printf("%zu %zu ", sizeof(CUlaunchConfig), offsetof(CUlaunchConfig, sharedMemBytes));
    printf("%zu ", offsetof(CUlaunchConfig, hStream));
    printf("%zu %zu ", offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs));
    printf("%d %zu", (int)CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, sizeof(void*));
    return 0;
}
"""
    *layout, cluster_id, pointer = _run_c(tmp_path, src, f"-I{inc}")
    assert pointer == 8 == ctypes.sizeof(ctypes.c_void_p)
    assert list(native.driver_layout()) == layout == [72, 8, 56, 24, 32, 40, 48]
    c = Path(launch.__file__).with_name("fastlaunch.c").read_text()
    assert re.findall(r"attr\.id = (\d+);", c) == [str(cluster_id)]


@needs_cc
def test_a_cache_entry_loads_without_a_compiler(empty_cache, monkeypatch):
    """A verified entry is loaded with no C compiler at all; without the entry the build fails with
    errors.BackendFailed naming the missing compiler, the same at every later launch."""
    launch.native()
    empty = empty_cache / "bin"
    empty.mkdir()
    monkeypatch.setenv("CC", str(empty_cache / "no-such-cc"))
    monkeypatch.setenv("PATH", str(empty))
    assert launch.compiler()[0] is None
    monkeypatch.setattr(launch, "_native_mod", [])
    assert launch.native().desc_size() == ctypes.sizeof(launch.Desc)
    cache.forget(launch.native_entry())
    monkeypatch.setattr(launch, "_native_mod", [])
    for _ in range(2):
        with pytest.raises(BackendFailed, match="needs a C compiler"):
            launch.Launch(0xF00, (1, 1, 1), 32, 0, 1, [(U64, 0)], [[(0, 0)]])
    assert launch.describe().startswith("unavailable") and "C compiler" in launch.describe()
    monkeypatch.setattr(replay, "ENABLED", True)
    assert replay_line() == launch.describe()


@needs_cc
def test_build_failures_are_named(empty_cache, monkeypatch):
    """A compiler that fails, no Python.h, a build whose Desc is not launch.Desc's: errors.BackendFailed
    saying which, nothing stored; a cache entry that does not load is rebuilt, with a warning."""

    def fails(match):
        monkeypatch.setattr(launch, "_native_mod", [])
        with pytest.raises(BackendFailed, match=match):
            launch.native()
        assert cache.load(launch.native_entry()) is None

    with monkeypatch.context() as m:
        m.setenv("CC", shutil.which("false"))
        fails("did not compile with .*false")
    with monkeypatch.context() as m:
        m.setattr(sysconfig, "get_paths", lambda: {"include": str(empty_cache)})
        fails("Python's headers")
    with monkeypatch.context() as m:
        m.setattr(launch, "MAX_FILLS", launch.MAX_FILLS - 1)
        fails("cannot be built or loaded here: its Desc .* is not launch.Desc's")
    cache.store(launch.native_entry(), b"not a shared library")
    monkeypatch.setattr(launch, "_native_mod", [])
    with pytest.warns(RuntimeWarning, match="did not load"):
        assert launch.native().desc_size() == ctypes.sizeof(launch.Desc)
    assert cache.load(launch.native_entry())[:4] == b"\x7fELF"


def test_compiler_and_info(monkeypatch):
    """$CC is a command with its flags; fs.info()'s replay line is describe(), and says when the replay is off."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("CC", f"{Path(cc).name} -O0 -g")
    assert launch.compiler()[0] == [cc, "-O0", "-g"]
    monkeypatch.setattr(launch, "_native_mod", [BackendFailed("no C compiler")])
    monkeypatch.setattr(replay, "ENABLED", True)
    assert replay_line() == "unavailable (no C compiler)"
    monkeypatch.setattr(replay, "ENABLED", False)
    assert replay_line() == "unavailable (no C compiler); the replay is off (FASTSOFTMAX_REPLAY=0)"


# ---- a Launch: its Desc, slots, regroup(), the calls fastlaunch refuses ----------------------------------


@needs_cc
def test_launch_desc_holds_the_bytes_and_the_slots(native):
    """The Desc: function, grid, block, shared memory, cluster, each parameter's offset, the argument bytes and,
    per address slot, the places it fills (a slot may fill several, or none); slots inside a by-value struct
    at the field's offset; the call keeps its Desc alive (the replay keeps only calls)."""
    args = [(U64, 0), (ctypes.c_int32, 4096), (U64, 0), (ctypes.c_float, 0.5)]
    ln = launch.Launch(0xF00, (3, 2, 1), 128, 64, 2, args, [[(0, 0)], [(2, 0), (0, 0)], []])
    d = ln.desc
    assert (d.function, list(d.grid), d.block, d.smem, d.cluster, d.n_params) == (0xF00, [3, 2, 1], 128, 64, 2, 4)
    assert list(d.offsets[:4]) == [0, 8, 16, 24] and d.n_bytes == 28 and ln.n_slots == d.n_slots == 3
    assert d.n_fills == 3 and list(d.fill_offset[:3]) == [0, 16, 0] and list(d.fill_slot[:3]) == [0, 1, 1]
    assert _bytes(ln) == launch.pack(args)[0] and ln.fills == [[0], [16, 0], []]
    s = launch.Launch(0xF01, (1, 1, 1), 32, 0, 1, [(ctypes.c_int32, 9), (_Args, _Args(0, 5))], [[(1, 0)], [(1, 16)]])
    assert s.fills == [[8], [24]] and list(s.desc.offsets[:2]) == [0, 8] and _bytes(s)[8:32] == bytes(_Args(0, 5))
    call = ln.call
    del ln, d
    gc.collect()
    assert call.desc.n_bytes == 28
    with pytest.raises(ValueError, match="more than a Desc holds: 65 parameters"):
        launch.Launch(0xF00, (1, 1, 1), 32, 0, 1, [(U64, 0)] * 65)


@needs_cc
def test_bad_calls_raise_python_errors(native):
    """More or fewer addresses than slots, too few arguments, more than MAX_ADDRESSES, something that is not
    a Desc's address, a value that is not an unsigned 64-bit integer: Python errors, before the driver (a
    call that got that far would find no libcuda here, or launch)."""
    ln = launch.Launch(0xF00, (1, 1, 1), 32, 0, 1, [(U64, 0), (U64, 0)], [[(0, 0)], [(1, 0)]])
    for addresses in ((), (1,), (1, 2, 3)):
        with pytest.raises(TypeError, match=f"takes 2 addresses, got {len(addresses)}"):
            ln.call(0, *addresses)
    with pytest.raises(TypeError, match="at least the Desc and the stream"):
        native.launch(ctypes.addressof(ln.desc))
    with pytest.raises(TypeError, match="at most 16 addresses, got 17"):
        native.launch(ctypes.addressof(ln.desc), 0, *range(17))
    with pytest.raises(ValueError, match="not a prepared Desc"):
        native.launch(0, 0)
    bad = launch.Desc(n_bytes=launch.MAX_BYTES + 1)
    with pytest.raises(ValueError, match="not a prepared Desc"):
        native.launch(ctypes.addressof(bad), 0)
    with pytest.raises(OverflowError):
        ln.call(-1, 1, 2)
    with pytest.raises(OverflowError):
        ln.call(0, 1, 2**64)
    with pytest.raises(TypeError):
        ln.call(0, 1, "2")


@needs_cc
def test_a_zero_grid_returns_0_without_the_driver(native):
    args = [(U64, 0)]
    for grid in ((0, 1, 1), (1, 0, 1), (1, 1, 0)):
        assert launch.Launch(0xF00, grid, 32, 0, 1, args, [[(0, 0)]]).call(0, 0x1000) == 0
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:  # no driver here: a call with something to run says so
        with pytest.raises(RuntimeError, match="cannot open libcuda.so.1"):
            launch.Launch(0xF00, (1, 1, 1), 32, 0, 1, args, [[(0, 0)]]).call(0, 0x1000)


@needs_cc
def test_regroup_merges_slots_and_nulls_the_rest(native):
    """New slots filling the places of several old ones, in the order given; an old slot in no group leaves
    null bytes in its places; the rest of the bytes and the launch's shape unchanged; the original untouched."""
    args = [(U64, 0x11), (U64, 0x22), (ctypes.c_int32, 7), (U64, 0x33)]
    ln = launch.Launch(0xF00, (2, 1, 1), 64, 16, 2, args, [[(0, 0)], [(1, 0)], [(3, 0)]])
    r = ln.regroup([[2, 0], [], [1]])
    assert r.fills == [[24, 0], [], [8]] and r.desc.n_slots == 3 and r.desc.n_fills == 3
    assert list(r.desc.fill_offset[:3]) == [24, 0, 8] and list(r.desc.fill_slot[:3]) == [0, 0, 2]
    assert (r.function, r.grid, r.block, r.smem, r.cluster) == (0xF00, (2, 1, 1), 64, 16, 2) and r.desc.cluster == 2
    assert struct.unpack_from("<QQiiQ", _bytes(ln.regroup([[0], [2]]))) == (0x11, 0, 7, 0, 0x33)
    assert ln.desc.n_slots == 3 and _bytes(ln) == launch.pack(args)[0]
    with pytest.raises(ValueError, match="more address slots"):
        ln.regroup([[0]] * (launch.MAX_ADDRESSES + 1))


# ---- retry(), the recording, the launch cache, the driver's context ----------------------------------------


class _Call:
    """A Launch as retry() uses it: call() returns the codes queued and keeps its arguments."""

    def __init__(self, *codes):
        self.codes, self.calls = list(codes), []

    def call(self, *a):
        self.calls.append(a)
        return self.codes.pop(0)


def test_retry_makes_a_context_current_once(monkeypatch):
    """INVALID_CONTEXT: device ``index``'s context made current and the launch made once more; that failing
    too, or another error: errors.BackendFailed naming what failed and the driver's error."""
    contexts = []
    monkeypatch.setattr(launch, "ensure_context", contexts.append)
    ln = _Call(0)
    launch.retry(ln, launch.INVALID_CONTEXT, 0x5EED, (1, 2), 3, "the k launch")
    assert contexts == [3] and ln.calls == [(0x5EED, 1, 2)]
    ln = _Call(launch.INVALID_CONTEXT)
    with pytest.raises(BackendFailed, match=f"^the k launch failed: {re.escape(launch.error_name(201))}$"):
        launch.retry(ln, launch.INVALID_CONTEXT, 0, (1,), 0, "the k launch")
    ln = _Call()
    with pytest.raises(BackendFailed, match=f"^the k launch failed: {re.escape(launch.error_name(700))}$"):
        launch.retry(ln, 700, 0, (1,), 0, "the k launch")
    assert contexts == [3, 0] and ln.calls == []  # another error: no context made, no second launch


class _Driver:
    """libcuda as ensure_context() and error_name() call it: no context current, device ``index`` is 7."""

    def __init__(self, fail=None, current=None):
        self.fail, self.current, self.calls = fail, current, []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append(name)
            if name == "cuCtxGetCurrent":
                args[0]._obj.value = self.current
            elif name == "cuDeviceGet":
                args[0]._obj.value = 7 + args[1]
            elif name == "cuDevicePrimaryCtxRetain":
                args[0]._obj.value = 0xC0 + args[1].value
            elif name == "cuCtxSetCurrent":
                self.current = args[0].value
            return 101 if name in (self.fail, "cuGetErrorName") else 0

        return call


def test_ensure_context_makes_the_primary_context_current(monkeypatch):
    drv = _Driver()
    monkeypatch.setattr(launch, "libcuda", lambda: drv)
    launch.ensure_context(1)
    assert drv.calls == ["cuCtxGetCurrent", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent"]
    assert drv.current == 0xC8
    drv.calls = []
    launch.ensure_context(1)  # one current already: nothing else asked
    assert drv.calls == ["cuCtxGetCurrent"]
    drv = _Driver(fail="cuDeviceGet")
    with pytest.raises(RuntimeError, match="^cuDeviceGet failed: CUresult 101$"):  # (no name: the number)
        launch.ensure_context(0)

    def missing():
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(launch, "libcuda", missing)
    assert launch.error_name(201) == "CUresult 201"


def test_recorded_appends_only_while_a_recording_is_open():
    x, y, ws, ln = torch.empty(4), torch.empty(4), torch.empty(8, dtype=torch.float64), object()
    launch.recorded(ln, (x,))
    launch.unrecorded()
    assert launch.recording() is None and launch.scratch(ws) is ws
    rec = launch.start()
    try:
        assert launch.recording() is rec and rec.ok and rec.launches == [] and rec.scratch == {}
        launch.recorded(ln, [x, y.data_ptr(), None])
        assert rec.launches == [(ln, (x, y.data_ptr(), None))] and rec.ok
        assert launch.scratch(ws) is ws and rec.scratch == {ws.data_ptr(): (8, torch.float64)}
        launch.unrecorded()
        assert not rec.ok
    finally:
        launch.abort()
    launch.recorded(ln, (y,))
    assert launch.recording() is None and len(rec.launches) == 1


def test_cached_makes_each_launch_once_and_is_bounded(monkeypatch):
    monkeypatch.setattr(launch, "_launches", {})
    monkeypatch.setattr(launch, "MAX_LAUNCHES", 2)
    made = []

    def make(name):
        return lambda: made.append(name) or name

    assert launch.cached("a", make("A")) == "A" and launch.cached("a", make("B")) == "A"
    assert launch.cached("b", make("B")) == "B" and made == ["A", "B"]
    assert launch.cached("c", make("C")) == "C" and launch.cached("a", make("A2")) == "A2"  # full: cleared


def test_hooks_idle_and_raw_stream(monkeypatch):
    """A launch hook registered with Triton (enter or exit) is seen; raw_stream is torch's current-stream call,
    and errors.BackendFailed where this torch has no CUDA."""
    from triton import knobs

    assert launch.hooks_idle()
    for name in ("launch_enter_hook", "launch_exit_hook"):
        with triton_hook(knobs.runtime, name, lambda *a: None):
            assert not launch.hooks_idle()
    assert launch.hooks_idle()
    getter = lambda index: 0x5EED  # noqa: E731
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", getter, raising=False)
    assert launch.raw_stream() is getter
    monkeypatch.delattr(torch._C, "_cuda_getCurrentRawStream")
    with pytest.raises(BackendFailed, match="not built with CUDA"):
        launch.raw_stream()
