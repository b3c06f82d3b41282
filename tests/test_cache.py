"""The on-disk cache (fastsoftmax/cache.py) without a GPU: no home directory only loses the cache; the
directory is private to the user; entries another user could have written, corrupt or truncated ones and a
library planted under an entry's name are refused (a warning names the file) and rebuilt; readers never see
a partial entry."""

import os
import stat
import subprocess
import sys
import threading
import warnings

import pytest

from fastsoftmax import cache

ROOT = os.getuid() == 0 if hasattr(os, "getuid") else False


@pytest.fixture
def cdir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("FASTSOFTMAX_CACHE_DIR", str(d))
    monkeypatch.setattr(cache, "_problems", {})
    return d


def _nvrtc():
    pytest.importorskip("cuda.bindings.nvrtc", reason="the CUDA backend's NVRTC bindings are a default dependency")
    from fastsoftmax.kernels.cuda import build

    build._memory.clear()
    return build


CFG = ("fwd", "float32", "float16")  # a configuration no other test compiles


def test_directory_and_entries_are_private(cdir):
    assert cache.store("a.bin", b"payload") == cdir / "a.bin"
    assert stat.S_IMODE(os.stat(cdir).st_mode) == 0o700 and stat.S_IMODE(os.stat(cdir / "a.bin").st_mode) == 0o600
    assert cache.load("a.bin") == b"payload" and cache.load("absent.bin") is None


def test_no_home_only_loses_the_cache(monkeypatch):
    """HOME unset and no passwd entry for this uid (containers): no cache, and compiling still works."""
    import pwd

    for var in ("FASTSOFTMAX_CACHE_DIR", "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(var, raising=False)

    def no_entry(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    assert cache.root() is None and cache.directory() is None and cache.store("x", b"1") is None
    build = _nvrtc()
    c = build.compile_kernel(build.Config(*CFG, group=16, rows=8), "sm_90a")
    assert len(c.binary) > 0 and not c.from_disk


def test_no_home_in_a_fresh_process(tmp_path):
    """A fresh process with no HOME whose uid has no passwd entry (pwd answers KeyError, as in containers
    that run an arbitrary uid) compiles a kernel and builds the launch helper, both without a cache."""
    code = (
        "import pwd\n"
        "def no_entry(uid): raise KeyError(uid)\n"
        "pwd.getpwuid = no_entry\n"
        "from fastsoftmax import cache\n"
        "from fastsoftmax.kernels import launch\n"
        "from fastsoftmax.kernels.cuda import build\n"
        "assert cache.root() is None\n"
        "c = build.compile_kernel(build.Config('fwd', 'float32', 'float16', group=16, rows=8), 'sm_90a')\n"
        "assert launch._load_native() is not None\n"
        "print(len(c.binary) > 0)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("HOME", "FASTSOFTMAX_CACHE_DIR", "XDG_CACHE_HOME")}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]


def test_a_directory_others_can_write_is_refused(cdir):
    cdir.mkdir(mode=0o700)
    os.chmod(cdir, 0o777)
    with pytest.warns(RuntimeWarning, match="writable by others"):
        assert cache.store("a.bin", b"x") is None
    assert list(cdir.iterdir()) == [] and str(cdir) in cache.problems()


def test_refused_entries_are_rebuilt(cdir):
    """Writable by others, truncated, and an entry renamed from another name: each refused with a warning
    naming it, removed, and the caller's rebuild stored again."""
    cache.store("a.bin", b"A" * 100)
    cache.store("b.bin", b"B" * 100)
    os.chmod(cdir / "a.bin", 0o666)
    with pytest.warns(RuntimeWarning, match=r"a\.bin.*writable by others"):
        assert cache.load("a.bin") is None
    assert not (cdir / "a.bin").exists()
    raw = (cdir / "b.bin").read_bytes()
    (cdir / "b.bin").write_bytes(raw[:-7])  # truncated
    with pytest.warns(RuntimeWarning, match=r"b\.bin.*corrupt"):
        assert cache.load("b.bin") is None
    cache.store("c.bin", b"C")
    os.replace(cdir / "c.bin", cdir / "d.bin")  # another entry's bytes under this name
    with pytest.warns(RuntimeWarning, match=r"d\.bin.*corrupt"):
        assert cache.load("d.bin") is None
    cache.store("b.bin", b"B" * 100)
    assert cache.load("b.bin") == b"B" * 100


def test_special_files_at_an_entry_are_refused_without_blocking(cdir):
    """A directory or a FIFO where an entry should be: refused with a warning naming it, the cache then written
    anew (a regression test: a directory's read escaped load() as IsADirectoryError, which took the kernel
    launcher down for the whole process, and opening a FIFO blocked the first launch forever)."""
    cdir.mkdir(mode=0o700)
    (cdir / "dir.bin").mkdir()
    os.mkfifo(cdir / "fifo.bin")
    done = []
    worker = threading.Thread(target=lambda: done.append([cache.load("dir.bin"), cache.load("fifo.bin")]), daemon=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        worker.start()
        worker.join(timeout=20)
    assert done == [[None, None]], "load() blocked on a FIFO"
    said = " ".join(str(w.message) for w in seen)
    assert "dir.bin: it is not a regular file" in said and "fifo.bin: it is not a regular file" in said, said
    assert not (cdir / "fifo.bin").exists()  # (removed: ours; a directory stays)
    assert cache.store("fifo.bin", b"F") == cdir / "fifo.bin" and cache.load("fifo.bin") == b"F"


def test_cache_directory_paths(tmp_path, monkeypatch):
    """A relative XDG_CACHE_HOME is ignored, as the XDG spec asks (it named a cache per working directory); a
    symbolic link given as the directory is refused saying so (it was "not a directory")."""
    monkeypatch.delenv("FASTSOFTMAX_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert cache.root() == tmp_path / "home" / ".cache" / "fastsoftmax" / "cuda"
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    monkeypatch.setenv("FASTSOFTMAX_CACHE_DIR", str(tmp_path / "link"))
    monkeypatch.setattr(cache, "_problems", {})
    with pytest.warns(RuntimeWarning, match="a symbolic link"):
        assert cache.directory() is None


def test_a_relative_or_home_cache_dir_stays_put(tmp_path, monkeypatch):
    """A relative FASTSOFTMAX_CACHE_DIR named a cache per working directory (entries missed after a chdir, a
    new directory in each); it is now taken from where the process first read it. ~ is expanded (it made a
    directory named ~)."""
    for sub in ("a", "b", "home"):
        (tmp_path / sub).mkdir()
    monkeypatch.setattr(cache, "_pinned", {}, raising=False)  # (a fresh process: nothing pinned yet)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path / "a")
    monkeypatch.setenv("FASTSOFTMAX_CACHE_DIR", "rel/cache")
    assert cache.root() == tmp_path / "a" / "rel" / "cache"
    monkeypatch.chdir(tmp_path / "b")
    assert cache.root() == tmp_path / "a" / "rel" / "cache"
    assert cache.directory() == tmp_path / "a" / "rel" / "cache" and not (tmp_path / "b" / "rel").exists()
    monkeypatch.setenv("FASTSOFTMAX_CACHE_DIR", "~/fs-cache")
    assert cache.root() == tmp_path / "home" / "fs-cache"


@pytest.mark.skipif(not ROOT, reason="needs root, to give a file to another user")
def test_entries_of_another_user_are_refused(cdir):
    cache.store("a.bin", b"x")
    os.chown(cdir / "a.bin", 54321, 54321)
    with pytest.warns(RuntimeWarning, match="owned by uid 54321"):
        assert cache.load("a.bin") is None
    os.chown(cdir, 54321, 54321)
    with pytest.warns(RuntimeWarning, match="owned by uid 54321"):
        assert cache.directory() is None


def test_corrupt_cubin_is_detected_and_rebuilt(cdir):
    build = _nvrtc()
    cfg = build.Config(*CFG, group=32, rows=4, k=1)
    first = build.compile_kernel(cfg, "sm_90a")
    (cubin,) = cdir.glob("*.cubin")
    raw = cubin.read_bytes()
    cubin.write_bytes(raw[: len(raw) // 2])  # a truncated cubin (a crash mid-write of an older version)
    build._memory.clear()
    with pytest.warns(RuntimeWarning, match=cubin.name):
        again = build.compile_kernel(cfg, "sm_90a")
    assert again.binary == first.binary and not again.from_disk
    build._memory.clear()
    assert build.compile_kernel(cfg, "sm_90a").from_disk  # stored whole again


def test_a_planted_library_never_runs(cdir, tmp_path):
    """A shared library planted under the launch helper's cache name (its constructor would write a file)
    is refused; the helper is rebuilt and loads."""
    from fastsoftmax.kernels import launch

    cc = os.environ.get("CC") or "cc"
    marker = tmp_path / "ran"
    src = tmp_path / "evil.c"
    body = f'static void f(void) {{ fclose(fopen("{marker}", "w")); }}'
    src.write_text(f"#include <stdio.h>\n__attribute__((constructor)) {body}\n")
    evil = tmp_path / "evil.so"
    if subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(evil)], capture_output=True).returncode:
        pytest.skip("no C compiler here")
    name = launch.native_entry()
    cdir.mkdir(mode=0o700)
    (cdir / name).write_bytes(evil.read_bytes())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        mod = launch._load_native()
    assert not marker.exists(), "the planted library's constructor ran"
    assert mod is not None and mod.desc_size() == launch.ctypes.sizeof(launch.Desc)
    assert any(name in str(w.message) for w in seen)
    assert cache.load(name) is not None  # the rebuilt helper, stored verified


def test_readers_never_see_a_partial_entry(cdir):
    """One thread rewrites an entry (a new 4 MiB content each time) while another reads it: every read is
    None or one whole content."""
    contents = [bytes([i]) * (4 << 20) for i in range(8)]
    cache.store("big.bin", contents[0])
    stop, bad = threading.Event(), []

    def reader():
        while not stop.is_set():
            got = cache.load("big.bin")
            if got is not None and got not in contents:
                bad.append(len(got))

    t = threading.Thread(target=reader)
    t.start()
    for c in contents * 3:
        cache.store("big.bin", c)
    stop.set()
    t.join()
    assert not bad and not list(cdir.glob(".tmp-*"))
