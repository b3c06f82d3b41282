"""The structure the design keeps (docs/architecture.md): few frames from a public call to its launch, no
import circles, no Python file over 500 lines, one C file and it a leaf, no build against torch's C++ API."""

import ast
import re
import sys
from pathlib import Path

import pytest
import torch

import fastsoftmax as fs
from fastsoftmax import heuristics

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "fastsoftmax"
MAX_FRAMES = 6  # fastsoftmax frames from the public call to the kernel launch, that call's frame included


def _ours(frame) -> int:
    n = 0
    while frame is not None:
        n += frame.f_code.co_filename.startswith(str(PKG))
        frame = frame.f_back
    return n


def frames_at_launch(run, is_launch) -> list[int]:
    """The fastsoftmax frames on the stack at each event ``is_launch(event, frame, arg)`` accepts while run()
    runs (sys.setprofile sees Python calls and C calls alike)."""
    seen = []

    def profile(frame, event, arg):
        if is_launch(event, frame, arg):
            seen.append(_ours(frame) if event == "c_call" else _ours(frame.f_back))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen


def _c_call_to(*names):
    def match(event, frame, arg):
        return event == "c_call" and getattr(arg, "__name__", None) in names

    return match


def _triton_launch(event, frame, arg):
    """The interpreted launch: kernels/triton/launch.py's launch() calling into Triton (kernel[grid](...),
    the interpreter on the CPU)."""
    if event != "call" or "triton" not in frame.f_code.co_filename or frame.f_back is None:
        return False
    caller = frame.f_back.f_code
    return caller.co_name == "launch" and caller.co_filename == str(PKG / "kernels" / "triton" / "launch.py")


def _fastlaunch_call(event, frame, arg):
    """The GPU launch: a call of _Visible.launch (below), which stands where fastlaunch's C launch is."""
    return event == "call" and frame.f_code is _Visible.launch.__code__


class _Visible:
    """fastlaunch with its launch made a Python call (a prepared launch calls it through functools.partial, a
    C call the profiler does not report): the frames counted are those of its caller."""

    def __init__(self, mod):
        self.mod = mod

    def __getattr__(self, name):
        return getattr(self.mod, name)

    def launch(self, *args):
        return self.mod.launch(*args)


@pytest.fixture
def visible_launches(device, monkeypatch):
    """On a GPU: launches made through _Visible (prepared anew: the caches of prepared launches and replays
    emptied); on the CPU, nothing to do (the interpreter's launch is a Python call)."""
    if device == "cuda":
        from fastsoftmax.kernels import launch, replay

        monkeypatch.setattr(launch, "_native_mod", [_Visible(launch.native())])
        monkeypatch.setattr(launch, "_launches", {})
        replay.clear()
        yield
        replay.clear()
    else:
        yield


def _launch(device):
    return _fastlaunch_call if device == "cuda" else _triton_launch


@pytest.mark.parametrize("case", ["softmax", "log_softmax", "softmax_backward", "cross_entropy"])
def test_frames_from_a_public_call_to_its_launch(device, case, visible_launches):
    """At most MAX_FRAMES fastsoftmax frames stand between fs.softmax / fs.cross_entropy (the first frame)
    and the kernel launch: on the Triton kernels (compiled on a GPU, the interpreter on the CPU) and on the
    CPU's torch ops; the first call and a call seen before (the replay, on a GPU) alike."""
    x = torch.randn(4, 513, device=device)
    y, t = torch.softmax(x, -1), torch.randint(0, 513, (4,), device=device)
    calls = {
        "softmax": lambda b: fs.softmax(x, backend=b),
        "log_softmax": lambda b: fs.log_softmax(x, backend=b),
        "softmax_backward": lambda b: fs.softmax_backward(x, y, backend=b),
        "cross_entropy": lambda b: fs.cross_entropy(x, t, backend=b),
    }
    call = calls[case]
    for _ in range(2):  # the first call, then the same call again (replayed on a GPU)
        seen = frames_at_launch(lambda: call("triton"), _launch(device))
        assert seen and max(seen) <= MAX_FRAMES, seen
    if device == "cpu":
        ops = ("_softmax", "_log_softmax", "_softmax_backward_data", "cross_entropy_loss")
        seen = frames_at_launch(lambda: call("auto"), _c_call_to(*ops))
        assert heuristics.last_plan().path in ("native", "native_cross_entropy")
        assert seen and max(seen) <= MAX_FRAMES, seen


def test_frames_under_autograd(device, visible_launches):
    """Eager autograd adds the Function's forward and nothing else: the launch stays within MAX_FRAMES."""
    x = torch.randn(4, 513, device=device, requires_grad=True)
    t = torch.randint(0, 513, (4,), device=device)
    for call in (lambda: fs.softmax(x, backend="triton"), lambda: fs.cross_entropy(x, t, backend="triton")):
        seen = frames_at_launch(call, _launch(device))
        assert seen and max(seen) <= MAX_FRAMES, seen


def _modules() -> dict[str, Path]:
    mods = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = p
    return mods


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's imports of other fastsoftmax modules, at any depth of its code (imports inside
    functions count: a circle through a deferred import is a circle)."""
    graph = {}
    for name, path in mods.items():
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for a in node.names:
                    found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        graph[name] = {m for m in found if m in mods and m != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    graph = _imports(_modules())
    assert graph["fastsoftmax.dispatch"], "the import graph was not read"  # (the check can fail)
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _kernel_uses(text: str) -> set:
    """(module, name) of each kernels("module").name in the text (triton/backend.kernels' lazy imports)."""
    return set(re.findall(r'kernels\("(\w+)"\)\.(\w+)', text))


def test_every_kernel_function_called_by_name_exists():
    """Each kernels("module").name in the package names something that module has: the calls that reach the
    Triton modules by name run on CUDA only in places (lm_head's scale_ did, and went missing unnoticed on
    the CPU; a regression)."""
    from fastsoftmax.kernels.triton.backend import kernels

    uses = set().union(*(_kernel_uses(p.read_text()) for p in PKG.rglob("*.py")))
    assert ("lm_head", "scale_") in uses and len(uses) >= 3  # (the check can fail)
    missing = sorted((m, name) for m, name in uses if not hasattr(kernels(m), name))
    assert missing == []
    assert _kernel_uses('kernels("lm_head").nothing_here(x)') == {("lm_head", "nothing_here")}


def test_no_python_file_over_500_lines():
    files = [p for d in ("src", "tests", "dev") for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 50
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}


def test_the_one_c_file_is_a_leaf():
    """fastlaunch.c, the only C in the package, reads no Python object by name, imports no module and makes
    no Python call: integers go in (a prepared launch's address, a stream, addresses), a launch comes out."""
    sources = [p for p in PKG.rglob("*") if p.suffix in (".c", ".cc", ".cpp", ".h", ".hpp")]
    assert [p.name for p in sources] == ["fastlaunch.c"]
    code = sources[0].read_text()
    banned = r"PyObject_GetAttr|PyImport_|PyDict_GetItem|PyObject_Call|PyObject_Vectorcall|PyModule_GetDict"
    assert not re.findall(banned, code)
    assert re.findall(r"PyLong_AsUnsignedLongLong", code)  # (what it does read: integers)


def test_no_build_against_torch():
    """Nothing in the package compiles against torch's headers or libraries (private APIs that change
    between releases): the only build is fastlaunch.c against Python's headers, as Triton's launchers."""
    text = "\n".join(p.read_text() for p in PKG.rglob("*.py"))
    for needle in ("-ltorch", "torch/extension.h", "cpp_extension", "TORCH_LIBRARY", "include_paths()"):
        assert needle not in text, needle
