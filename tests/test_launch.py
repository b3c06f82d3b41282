"""cuda/launch.py without a GPU: the argument bytes a prepared launch hands the driver, and the driver
structures' layouts (cuda.h, 64-bit)."""

import ctypes
import struct

from fastsoftmax.cuda import launch
from fastsoftmax.cuda.kernels import _Params


def test_pack_lays_parameters_out_as_the_compiler_does():
    p = _Params(0x1000, 0x2000, None, None, 5, 1, *range(11), 4097, 1)
    args = [(ctypes.c_uint64, 7), (ctypes.c_int32, -3), (ctypes.c_float, 1.5), (ctypes.c_int8, 1),
            (ctypes.c_uint64, 9), (_Params, p), (ctypes.c_int64, -2)]  # fmt: skip
    buf, offsets = launch.pack(args)
    assert offsets == [0, 8, 12, 16, 24, 32, 32 + ctypes.sizeof(_Params)]
    raw = bytes(buf)
    assert struct.unpack_from("<Qifb", raw, 0) == (7, -3, 1.5, 1)
    assert struct.unpack_from("<Q", raw, 24) == (9,)
    assert raw[32 : 32 + ctypes.sizeof(_Params)] == bytes(p)
    assert struct.unpack_from("<q", raw, offsets[-1]) == (-2,)
    x = ctypes.c_uint64.from_buffer(buf, offsets[5] + _Params.x.offset)  # how a slot is filled
    x.value = 0xABC0
    assert struct.unpack_from("<QQ", bytes(buf), 32) == (0xABC0, 0x2000)


def test_driver_structures():
    assert ctypes.sizeof(launch._Attribute) == 72 and launch._Attribute.x.offset == 8
    c = launch._Config
    assert ctypes.sizeof(c) == 56
    assert (c.smem.offset, c.stream.offset, c.attrs.offset, c.num_attrs.offset) == (24, 32, 40, 48)
