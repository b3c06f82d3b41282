"""The eager replay on CPU tensors (kernels/replay.py): the torch backend's call made again, its leaf chosen
on the first call (kernels/torch_native.py's softmax_call, softmax_backward_call)."""

import pytest
import torch

from fastsoftmax import heuristics
from fastsoftmax.kernels import replay


def _cpu_cases():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 513, generator=g) * 4
    x[1] = float("-inf")  # a fully masked row: the conventions the native call applies after torch's kernel
    x[2, 7] = 80.0
    dy = torch.randn(5, 513, generator=g)
    y, ly = torch.softmax(x, -1).nan_to_num(0.0), torch.log_softmax(x, -1)
    ly[1] = float("-inf")  # (the library's log_softmax of a fully masked row; torch's is NaN)
    t = torch.randint(0, 513, (5,), generator=g)
    cw = torch.rand(513, generator=g) + 0.5
    t[3] = -100
    import fastsoftmax as fs

    return {
        "softmax": lambda: fs.softmax(x),
        "log_softmax": lambda: fs.log_softmax(x.t(), 0),
        "softmax_backward": lambda: fs.softmax_backward(dy, y),
        "log_softmax_backward": lambda: fs.log_softmax_backward(dy, ly, dtype=torch.float64),
        "cross_entropy": lambda: fs.cross_entropy(x[[0, 2, 3, 4]], t[[0, 2, 3, 4]]),
        "cross_entropy none, z": lambda: torch.stack(
            fs.cross_entropy(x[[0, 2]].view(2, 1, 513), t[[0, 2]].view(2, 1), reduction="none", return_z_loss=True)
        ),
        "cross_entropy weighted": lambda: fs.cross_entropy(x[[0, 2]], t[[0, 2]], class_weight=cw),
    }


@pytest.mark.parametrize("case", list(_cpu_cases()))
def test_cpu_calls_replay_the_torch_call(monkeypatch, case):
    """A plain call on CPU tensors seen before makes the torch backend's call again (a ``torch_call`` replay),
    bit-identical to its full path, with no check or choice before it (dispatch.select is not called) and
    the native path's plan recorded; under heuristics.force the full path runs again."""
    from fastsoftmax import dispatch

    monkeypatch.setattr(replay, "ENABLED", True)
    replay.clear()
    run = _cpu_cases()[case]
    calls = count_calls(monkeypatch, dispatch, "select_loss" if "cross" in case else "select")
    first = run()
    assert [r.__name__ for r in replay.entries()] == ["torch_call"]
    n = len(calls)
    heuristics.record(None)
    again = run()
    assert len(calls) == n and torch.equal(again, first) and again.dtype == first.dtype
    assert heuristics.last_plan().backend == "torch" and heuristics.last_plan().path.startswith("native")
    with heuristics.force(path="online"):
        assert torch.equal(run(), first)
    assert len(calls) == n + 1
    replay.clear()


def test_a_cpu_replay_leaves_a_bad_target_to_the_full_path(monkeypatch):
    """A recorded cross-entropy call whose target is then out of range: torch's IndexError inside the replay
    sends the call to the full path, which raises the library's error."""
    import fastsoftmax as fs

    monkeypatch.setattr(replay, "ENABLED", True)
    replay.clear()
    x, t = torch.randn(4, 10), torch.tensor([1, 2, 3, 4])
    fs.cross_entropy(x, t)
    assert [r.__name__ for r in replay.entries()] == ["torch_call"]
    with pytest.raises(IndexError, match="target 10 at row 2 is outside"):
        fs.cross_entropy(x, torch.tensor([1, 2, 10, 4]))
    replay.clear()


@pytest.mark.parametrize("case", ["softmax", "cross_entropy"])
def test_a_call_during_which_a_force_opened_is_not_kept(monkeypatch, case):
    """heuristics.force is process-wide: a block another thread opens (and may close) while a call's kernels
    run can set the launch it records. Such a recording is not kept; the next call takes the full path and
    is kept (the block opened and closed inside the backend's call, where the other thread's would)."""
    from fastsoftmax import dispatch

    monkeypatch.setattr(replay, "ENABLED", True)
    replay.clear()
    backend, name = dispatch.BACKENDS["torch"], "cross_entropy" if "cross" in case else "forward"
    real = getattr(backend, name)

    def under_a_force(*a, **k):
        with heuristics.force(path="online"):
            pass
        return real(*a, **k)

    monkeypatch.setattr(backend, name, under_a_force)
    run = _cpu_cases()[case]
    first = run()
    assert replay.entries() == []
    monkeypatch.setattr(backend, name, real)
    assert torch.equal(run(), first)
    assert [r.__name__ for r in replay.entries()] == ["torch_call"]
    replay.clear()


def count_calls(monkeypatch, module, name):
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(a) or real(*a, **k))
    return calls


@pytest.mark.parametrize("m", [1, 2, 64, 65])
@pytest.mark.parametrize("fn", ["softmax", "log_softmax", "softmax_backward", "log_softmax_backward"])
def test_cpu_replay_leaf_finds_rows_its_first_call_had_not(monkeypatch, fn, m):
    """A CPU call's replay calls the leaf its first call chose: torch's kernel with a first-element test
    chosen for the row count where the call is the usual one (rows in memory, the tensors' own dtype;
    log_softmax in fp32), torch_native's whole function otherwise. A fully masked row that only a later
    call holds is still found (0, -inf; its gradient 0 whatever dy holds there), a NaN row stays NaN,
    against the full path's output, bit for bit."""
    import inspect

    import fastsoftmax as fs
    from fastsoftmax.kernels import torch_native

    monkeypatch.setattr(replay, "ENABLED", True)
    call = getattr(fs, fn)
    log, backward = fn.startswith("log"), fn.endswith("backward")
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        replay.clear()
        g = torch.Generator().manual_seed(m)
        x = (torch.randn(m, 513, generator=g) * 4).to(dtype)
        dy = torch.randn(m, 513, generator=g).to(dtype)
        y = (torch.log_softmax if log else torch.softmax)(x, -1)

        def run(x, y, dy):
            return call(dy, y) if backward else call(x)

        run(x, y, dy)  # (recorded: no masked row)
        ((key, entry),) = replay._cache.items()
        leaf = inspect.getclosurevars(entry).nonlocals["fn"].__name__
        usual = backward or not log or dtype is torch.float32
        want = ("_usual_softmax_backward" if backward else "_usual_softmax") if usual else "native_softmax"
        assert leaf == want, (dtype, leaf)
        x2, dy2 = x.clone(), dy.clone()
        x2[m - 1] = float("-inf")
        y2 = y.clone()
        y2[m - 1] = float("-inf") if log else 0.0
        dy2[m - 1, 5] = float("nan")
        made = []
        replay._cache[key] = lambda *a, made=made, entry=entry: made.append(entry(*a)) or made[-1]
        out = run(x2, y2, dy2)
        assert len(made) == 1 and made[0] is out  # (the replay's output)
        monkeypatch.setattr(replay, "ENABLED", False)
        replay.clear()
        full = run(x2, y2, dy2)  # (the full path)
        monkeypatch.setattr(replay, "ENABLED", True)
        assert len(made) == 1 and torch.equal(out, full), (dtype, fn)
        assert (out[m - 1] == (0.0 if backward or not log else float("-inf"))).all(), (dtype, fn)
        if m > 1:
            assert not out[: m - 1].isnan().any()
        if not backward:
            x2[m - 1, 3] = float("nan")
            assert run(x2, y2, dy2)[m - 1].isnan().all()
    replay.clear()
    assert torch_native.READ_ROWS == 64  # (m = 65: past the rows read from memory, torch ops)
