"""fastlaunch_torch.cpp, fastlaunch.c's calls into torch through its C++ API, built on first use.

It is compiled with the C++ compiler against the running torch's headers and libraries, once per torch
build and compiler command (the cache entry's name hashes the sources, torch's version and path, and the
command), and stored in the disk cache (cache.py). A cached build loads at once. A compile (15-35 s) runs in
a detached process, so the first calls never wait for it and a short script's exit does not lose it: the
process takes a lock in the cache directory (one build at a time across processes), builds, and stores
either the module or its failure (a failed build is not retried until that entry is removed). A daemon
thread of the calling process waits for it, loads the result and hands the table to whoever asked
(``ready``). Until then, or where it cannot be built, fastlaunch.c reaches torch through Python.
"""

from __future__ import annotations

import threading

from .errors import BackendFailed

_WHAT = "fastlaunch_torch.cpp, fastsoftmax's calls into torch"
_lock = threading.Lock()
_calls: list = []  # [fastlaunch_torch's capsule] once loaded, or [the BackendFailed saying why not]
_module: list = []  # [fastlaunch_torch, the module] once loaded
_build: list = []  # [the thread waiting for the build] where no cached build was found
_ready: list = []  # callbacks for the capsule, once the thread has it


def torch_calls(wait: bool = True, ready=None):
    """The capsule of fastlaunch_torch.cpp's table, or None where it cannot be had (describe() says why).
    wait=False returns None while a build runs; ``ready(capsule)`` is then called from the waiting thread
    once it is loaded (not at all where the build fails)."""
    if not _calls:
        with _lock:
            if not _calls and not _build:
                from . import cache

                name = _entry()
                if (failed := cache.load(name + ".failed")) is not None:
                    _calls.append(BackendFailed(failed.decode(errors="replace")))
                elif cache.load(name) is not None:
                    _calls.append(_load())
                else:
                    thread = threading.Thread(target=_wait_for_build, name="fastsoftmax-build", daemon=True)
                    _build.append(thread)
                    thread.start()
            if not _calls and ready is not None:
                _ready.append(ready)
        if wait and not _calls:
            _build[0].join()
    if not _calls:
        return None
    calls = _calls[0]
    return None if isinstance(calls, Exception) else calls


def row_kernels():
    """fastlaunch_torch's module, for its row kernels (cpu_rows.h) as Python calls them, once loaded; None
    until then (the build started where it was not) or where it cannot be built."""
    if not _calls:
        torch_calls(wait=False)
    return _module[0] if _module and _calls and not isinstance(_calls[0], Exception) else None


def describe() -> str:
    """How fastlaunch.c reaches torch, for fs.info() (builds nothing)."""
    if not _calls:
        return "Python's calls until fastlaunch_torch.cpp is built" if _build else "not asked yet"
    calls = _calls[0]
    return f"Python's calls ({calls})" if isinstance(calls, Exception) else "fastlaunch_torch.cpp"


def _load():
    """The capsule, from the cache or built here; or the BackendFailed saying why it cannot be had."""
    from .launch import load_built

    try:
        mod = load_built(_entry(), "fastlaunch_torch", _command, _has_table, _WHAT, 600)
        _module[:] = [mod]
        return mod.table()
    except Exception as e:  # the compiler's or the loader's failure, named
        return e if isinstance(e, BackendFailed) else BackendFailed(f"{_WHAT}: {e}")


def _wait_for_build() -> None:
    """(the daemon thread) The detached build run and waited for, then its result loaded: from the cache, or
    its recorded failure; built here where no process could be started or nothing was stored."""
    from . import cache

    _spawn_build()
    failed = cache.load(_entry() + ".failed")
    calls = BackendFailed(failed.decode(errors="replace")) if failed is not None else _load()
    with _lock:
        _calls.append(calls)
        ready = list(_ready) if not isinstance(calls, Exception) else []
        _ready.clear()
    for fn in ready:
        fn(calls)


def _spawn_build() -> None:
    """build_entry() in a detached Python process (its own session: it outlives this one), waited for."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from . import cache

    if cache.directory() is None:
        return  # (nowhere to store it: _load builds it in this process)
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])  # (this very package, wherever it was imported from)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    code = "from fastsoftmax.torch_build import build_entry; build_entry()"
    try:
        subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            timeout=900,
        )
    except (OSError, subprocess.SubprocessError):
        pass


def build_entry() -> None:
    """(the detached process) fastlaunch_torch.cpp built into the cache, or its failure stored there as the
    entry's '.failed' companion; under a lock in the cache directory, so that processes starting at once
    build it once."""
    import fcntl

    from . import cache

    d, name = cache.directory(), _entry()
    if d is None:
        return
    with open(d / (name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if cache.load(name) is not None or cache.load(name + ".failed") is not None:
            return
        calls = _load()
        if isinstance(calls, Exception):
            cache.store(name + ".failed", str(calls).encode())


def _entry() -> str:
    """The cache entry name: the sources, torch's build and location, the compiler's command, Python's ABI."""
    import hashlib
    import sysconfig
    from pathlib import Path

    import torch

    from . import cache

    here = Path(__file__).parent
    code = b"".join((here / f).read_bytes() for f in ("fastlaunch_torch.cpp", "fastlaunch_torch.h", "cpu_rows.h"))
    build = f"{torch.__version__} {torch.version.git_version} {Path(torch.__file__).parent}"
    try:
        command = " ".join(_command("OUT"))
    except BackendFailed as e:
        command = str(e)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    key = code + f"{build}\n{command}\n{suffix}".encode() + bytes([cache.FORMAT])
    return f"fastlaunch_torch-{hashlib.sha256(key).hexdigest()[:16]}{suffix}"


def _command(so) -> list[str]:
    """The C++ compiler's command building fastlaunch_torch.cpp into ``so``: $CXX (a command, its flags
    included) where set, else c++ or g++ on PATH; against the running torch's headers and libraries, in its
    C++ ABI (C++20, spelled as gcc 9 and clang 9 accept it: torch's newest headers require it; older ones
    compile under it too); for the vector ISA of _isa()."""
    import os
    import shlex
    import shutil
    from pathlib import Path

    import torch

    from .launch import compiler

    cxx = shlex.split(os.environ.get("CXX", ""))
    path = shutil.which(cxx[0]) if cxx else shutil.which("c++") or shutil.which("g++")
    include = compiler()[1]
    if path is None or include is None:
        raise BackendFailed("no C++ compiler (c++ or g++ on PATH, or $CXX)" if path is None else "no Python.h")
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    src = Path(__file__).with_name("fastlaunch_torch.cpp")
    return [path, *cxx[1:], "-O2", *_isa(), "-std=c++2a", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}", f"-I{include}",
            str(src), "-o", str(so), f"-L{root / 'lib'}", "-lc10", "-ltorch_cpu", "-ltorch_python",
            f"-Wl,-rpath,{root / 'lib'}"]  # fmt: skip


def _isa() -> list[str]:
    """The compiler's flags for the row kernels' vectors (cpu_rows.h): AVX-512 (F, BW, VL, DQ: what torch's
    check asks of the CPU), AVX2 and FMA where torch's own CPU kernels run with AVX-512 on this machine; AVX2
    and FMA where they run with AVX2 (its capability check, which ATEN_CPU_CAPABILITY can lower); else the
    architecture's baseline (SSE2, NEON). Part of the cache entry's name: a cache shared by machines of other
    ISAs holds an entry for each."""
    import platform

    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    if capability.startswith("AVX512"):
        return ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"]
    return ["-mavx2", "-mfma"] if capability.startswith("AVX2") else []


def _has_table(mod):
    mod.table()
    return mod
