"""cuda/launch.py without a GPU: the argument bytes a prepared launch hands the driver, the driver structures'
layouts (cuda.h, 64-bit), and fastlaunch.c built and agreeing with launch.Desc."""

import ctypes
import gc
import shutil
import struct
import sysconfig
from pathlib import Path

import pytest

from fastsoftmax.cuda import launch
from fastsoftmax.cuda.kernels import _Params


def test_pack_lays_parameters_out_as_the_compiler_does():
    p = _Params(0x1000, 0x2000, None, None, 5, 1, *range(11), 4097, 1)
    args = [(ctypes.c_uint64, 7), (ctypes.c_int32, -3), (ctypes.c_float, 1.5), (ctypes.c_int8, 1),
            (ctypes.c_uint64, 9), (_Params, p), (ctypes.c_int64, -2)]  # fmt: skip
    raw, offsets = launch.pack(args)
    assert offsets == [0, 8, 12, 16, 24, 32, 32 + ctypes.sizeof(_Params)]
    assert struct.unpack_from("<Qifb", raw, 0) == (7, -3, 1.5, 1)
    assert struct.unpack_from("<Q", raw, 24) == (9,)
    assert raw[32 : 32 + ctypes.sizeof(_Params)] == bytes(p)
    assert struct.unpack_from("<q", raw, offsets[-1]) == (-2,)


def test_driver_structures():
    assert ctypes.sizeof(launch._Attribute) == 72 and launch._Attribute.x.offset == 8
    c = launch._Config
    assert ctypes.sizeof(c) == 56
    assert (c.smem.offset, c.stream.offset, c.attrs.offset, c.num_attrs.offset) == (24, 32, 40, 48)


def _can_build() -> bool:
    include = sysconfig.get_paths().get("include")
    return bool((shutil.which("cc") or shutil.which("gcc")) and include and Path(include, "Python.h").exists())


@pytest.mark.skipif(not _can_build(), reason="no C compiler or Python headers here")
def test_native_launcher_builds_and_agrees_on_desc(tmp_path, monkeypatch):
    """fastlaunch.c compiles, loads, has launch.Desc's size; a prepared launch's Desc holds the argument
    bytes and the slots where each role's address goes; a bad call raises a Python error."""
    monkeypatch.setenv("FASTSOFTMAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(launch, "_native_mod", [])
    mod = launch._native()
    assert mod is not None and mod.desc_size() == ctypes.sizeof(launch.Desc)
    assert list(tmp_path.glob("fastlaunch-*"))  # built into the cache
    args = [(ctypes.c_uint64, 0), (ctypes.c_int32, 4096), (ctypes.c_uint64, 0), (ctypes.c_float, 0.5)]
    ln = launch.Launch(0xF00, (3, 1, 1), 128, 64, 1, args, [(0, 0, "x"), (2, 0, "y"), (0, 0, "y")])
    d = ln.desc
    assert (d.function, list(d.grid), d.block, d.smem, d.cluster, d.n_params) == (0xF00, [3, 1, 1], 128, 64, 1, 4)
    assert list(d.offsets[:4]) == [0, 8, 16, 24] and d.n_bytes == 28
    assert list(d.slots[0]) == [0, -1, -1, -1] and list(d.slots[1]) == [16, 0, -1, -1]
    assert list(d.slots[2]) == [-1] * 4 and list(d.slots[3]) == [-1] * 4
    raw = ctypes.string_at(ctypes.addressof(d) + launch.Desc.bytes.offset, d.n_bytes)
    assert raw == launch.pack(args)[0] and struct.unpack_from("<i", raw, 8) == (4096,)
    call = ln.call
    del ln, d
    gc.collect()
    assert call.desc.n_bytes == 28  # the call keeps its Desc alive: fastpath keeps only calls
    with pytest.raises(TypeError):
        call(0, 1, 2)
    with pytest.raises(OverflowError):
        call(-1, 0, 0, 0, 0)
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:  # no driver here: a well-formed call says so
        with pytest.raises(RuntimeError, match="libcuda"):
            call(0, 0, 0, 0, 0)
    assert not launch.preparable([(ctypes.c_uint64, 0)] * 65, [])
    with pytest.raises(ValueError, match="Desc holds"):
        launch.Launch(0xF00, (1, 1, 1), 32, 0, 1, [(ctypes.c_uint64, 0)] * 65)
    assert not launch.preparable(args, [(0, 0, "x")] * 5)
