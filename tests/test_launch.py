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


class CudaLauncher:  # the name fastpath._direct checks: Triton 3.6's launcher class
    global_scratch_size = profile_scratch_size = 0
    launch = staticmethod(len)  # a builtin, as Triton's C launch function is
    launch_cooperative_grid = launch_pdl = False


def _fake_triton_step(signature, vals, slots, **meta):
    from types import SimpleNamespace

    md = dict(num_warps=4, shared=128, num_ctas=1, launch_pdl=False, launch_cooperative_grid=False) | meta
    ck = SimpleNamespace(run=CudaLauncher(), function=0xABC, metadata=SimpleNamespace(**md),
                         src=SimpleNamespace(signature=signature))  # fmt: skip
    return ("triton", ck, (3, 1, 1), vals, slots)


@pytest.mark.skipif(not _can_build(), reason="no C compiler or Python headers here")
def test_triton_launch_prepared_from_its_signature(tmp_path, monkeypatch):
    """fastpath._prepared turns a recorded Triton launch into a Desc as Triton 3.6's launcher would pass it:
    constexprs dropped, pointers as 8-byte slots (the call's tensors' and a workspace's), integers and
    floats by their types, the two scratch pointers last (null); block = 32 x num_warps; what it cannot
    build it refuses (None), for the replay to fall back."""
    import torch

    from fastsoftmax import fastpath

    monkeypatch.setenv("FASTSOFTMAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(launch, "_native_mod", [])
    ws = ("scratch", 0, 16, torch.float32)
    sig = {"x": "*bf16", "y": "*bf16", "n": "i32", "BLOCK": "constexpr", "scale": "fp32", "flag": "i1", "g": "i8",
           "w": "*fp32", "big": "i64"}  # fmt: skip
    vals = [None, None, 4096, 1024, 0.5, True, -2, None, -3]
    slots = [(0, "x"), (1, "y"), (7, ws)]
    ((ln, role),) = fastpath._prepared([_fake_triton_step(sig, vals, slots)])
    d = ln.desc
    assert role == ws and (d.function, list(d.grid), d.block, d.smem, d.cluster) == (0xABC, [3, 1, 1], 128, 128, 1)
    assert d.n_params == 10 and list(d.offsets[:10]) == [0, 8, 16, 20, 24, 25, 32, 40, 48, 56]
    raw = ctypes.string_at(ctypes.addressof(d) + launch.Desc.bytes.offset, d.n_bytes)
    assert struct.unpack_from("<ifbb", raw, 16) == (4096, 0.5, 1, -2)
    assert struct.unpack_from("<qQQ", raw, 40) == (-3, 0, 0)
    assert [list(d.slots[k]) for k in range(4)] == [[0, -1, -1, -1], [8, -1, -1, -1], [-1] * 4, [32, -1, -1, -1]]
    refused = [
        _fake_triton_step({**sig, "t": ("i32", "i32")}, [*vals, (1, 2)], slots),  # a tuple argument
        _fake_triton_step(sig, vals, slots, num_ctas=2),  # a cluster launch of Triton's
        _fake_triton_step({**sig, "h": "fp16"}, [*vals, 1.0], slots),  # a type not built here
        _fake_triton_step(sig, [*vals[:7], 1234, -3], slots[:2]),  # a pointer that is not one of the call's
        _fake_triton_step({**sig, "v": "*fp32"}, [*vals, None], [*slots, (9, ("scratch", 1, 16, torch.float32))]),
    ]  # (the last: two workspaces in one launch)
    for step in refused:
        assert fastpath._prepared([step]) is None, step[1].src.signature


def test_info_says_how_replays_launch(monkeypatch):
    import fastsoftmax as fs
    from fastsoftmax import fastpath

    monkeypatch.setattr(launch, "_native_mod", [])
    assert fs.info()["replay"] == "fastlaunch.c (built on the first replay)" and launch._native_mod == []
    monkeypatch.setattr(launch, "_native_mod", [None])
    assert fs.info()["replay"].startswith("ctypes")
    monkeypatch.setenv("FASTSOFTMAX_NATIVE_LAUNCH", "0")
    assert fs.info()["replay"] == "ctypes (FASTSOFTMAX_NATIVE_LAUNCH=0)"
    monkeypatch.setattr(fastpath, "ENABLED", False)
    assert fs.info()["replay"].startswith("off")
