"""The on-disk cache of built artefacts (the CUDA backend's cubins, the launch helper's shared library):
private to the user, written atomically, verified when read.

Directory: $FASTSOFTMAX_CACHE_DIR (~ expanded; a relative one from the working directory where the process
first read it), else $XDG_CACHE_HOME/fastsoftmax/cuda, else ~/.cache/fastsoftmax/cuda; no home
(HOME unset and no passwd entry, as in some containers): no cache. It is created with mode 0700, and an
existing one is used only if it is a directory owned by this user and writable by no one else. An entry is
one file, ``<name>``: a header holding the name and the SHA-256 of the name and content, then the content.
It is read only if it is a regular file owned by this user, writable by no one else, whose header matches
its name and content; anything else (truncated, corrupt, planted by another user, renamed from another
entry) is reported once by a warning naming the file, removed where we own it, and rebuilt by the caller.
Writes go to a temporary file in the directory, then are renamed into place: a reader, in this process or
another, sees a whole entry or none. Every failure of the cache itself only loses the cache.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
import threading
import warnings
from pathlib import Path

FORMAT = 1  # part of every entry's name (build.py, launch.py): files of another format are never read
MAGIC = b"fastsoftmax cache entry %d\n" % FORMAT

_problems: dict[str, str] = {}  # directory or file -> why it was refused (reported once each)
_lock = threading.Lock()


def _home_cache() -> Path | None:
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):  # (the XDG spec: a relative one is invalid, ignored)
        return Path(xdg) / "fastsoftmax" / "cuda"
    try:
        return Path.home() / ".cache" / "fastsoftmax" / "cuda"
    except (RuntimeError, KeyError, OSError):  # no HOME and no passwd entry for this uid
        return None


_pinned: dict[str, Path] = {}  # FASTSOFTMAX_CACHE_DIR's values -> the absolute directory each named first


def root() -> Path | None:
    """The cache directory as configured (not yet created or checked), or None where there is none. A
    FASTSOFTMAX_CACHE_DIR with ~ is expanded, and a relative one taken from the working directory where this
    process first read that value (not a cache per directory as the process moves)."""
    env = os.environ.get("FASTSOFTMAX_CACHE_DIR")
    if not env:
        return _home_cache()
    with _lock:
        if env not in _pinned:
            _pinned[env] = Path(os.path.abspath(os.path.expanduser(env)))
        return _pinned[env]


def _owned_privately(st: os.stat_result) -> str | None:
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    if uid is not None and st.st_uid != uid:
        return f"owned by uid {st.st_uid}, not this user ({uid})"
    if st.st_mode & 0o022:
        return f"writable by others (mode {stat.filemode(st.st_mode)})"
    return None


def _refuse(path, why: str, what: str) -> None:
    key = str(path)
    with _lock:
        if key in _problems:
            return
        _problems[key] = why
    warnings.warn(f"fastsoftmax: not using the cache {what} {key}: {why}", RuntimeWarning, stacklevel=3)


def directory() -> Path | None:
    """The cache directory (created private to the user), or None when there is no usable cache."""
    d = root()
    if d is None:
        return None
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(d)
    except OSError as e:
        _refuse(d, f"cannot create it ({e.strerror or e})", "directory")
        return None
    if not stat.S_ISDIR(st.st_mode):
        why = (
            "it is a symbolic link (name the directory itself)" if stat.S_ISLNK(st.st_mode) else "it is not a directory"
        )
        _refuse(d, why, "directory")
        return None
    if why := _owned_privately(st):
        _refuse(d, why, "directory")
        return None
    return d


def problems() -> dict[str, str]:
    """What the cache refused so far in this process (path -> why), for fs.info()."""
    with _lock:
        return dict(_problems)


def _header(name: str, data: bytes) -> bytes:
    """An entry's first bytes (always of the same length for a name): the format, the name, the SHA-256 of
    the name and content."""
    return MAGIC + name.encode() + b"\n" + hashlib.sha256(name.encode() + b"\0" + data).hexdigest().encode() + b"\n"


def load(name: str) -> bytes | None:
    """The content of entry ``name``, or None (absent, or refused: then it is removed where we own it)."""
    d = directory()
    if d is None:
        return None
    path = d / name
    try:  # (O_NONBLOCK: opening a FIFO planted there must not wait for a writer)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return None
    except OSError as e:
        _refuse(path, f"cannot open it ({e.strerror or e})", "entry")
        return None
    try:
        st = os.fstat(fd)
        why = "it is not a regular file" if not stat.S_ISREG(st.st_mode) else _owned_privately(st)
        raw = b"".join(iter(lambda: os.read(fd, 1 << 20), b"")) if why is None else b""
    except OSError as e:
        why = f"cannot read it ({e.strerror or e})"
    finally:
        os.close(fd)
    if why is None:
        n = len(_header(name, b""))
        if raw[:n] == _header(name, raw[n:]):
            return raw[n:]
        why = "corrupt (truncated, or not the entry its name says); it is rebuilt"
    _refuse(path, why, "entry")
    forget(name)
    return None


def store(name: str, data: bytes) -> Path | None:
    """Write entry ``name`` atomically; its path, or None when there is no usable cache."""
    d = directory()
    if d is None:
        return None
    try:
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-")  # mode 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_header(name, data) + data)
            os.replace(tmp, d / name)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        _refuse(d, f"cannot write to it ({e.strerror or e})", "directory")
        return None
    return d / name


def forget(name: str) -> None:
    """Remove entry ``name`` if this user owns it (a refused or unloadable one)."""
    d = root()
    if d is None:
        return
    try:
        if not hasattr(os, "geteuid") or os.lstat(d / name).st_uid == os.geteuid():
            (d / name).unlink()
    except OSError:
        pass
