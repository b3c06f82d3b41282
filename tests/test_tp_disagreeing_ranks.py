"""fastsoftmax.distributed on 2 gloo processes whose calls disagree (rows, dtypes, options, targets): every
rank raises the same ValueError and no collective hangs; a target outside [0, V) raises IndexError on every
rank; ranks passing different memory= agree; double backward is refused; an argument check that fails on one
rank raises there and on every other rank (tests/helpers.py's tensor-parallel problems)."""

import contextlib
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import CAP, EPS, ZL, M, N, V, ce_logits, class_weights, lce_problem, spawn_gloo, targets

# ---- ranks that disagree, bad targets, double backward --------------------------------------------------------


def _disagreements(rank):
    """(function, case, call) where the ranks differ: rank 1's rows, dtype or options differ from rank 0's."""
    import fastsoftmax.distributed as fsd

    x = ce_logits(torch.float32, masked=False)[:, rank * 11 : rank * 11 + 11 + rank]
    t = targets()
    kept = torch.where(t < 0, 3, t)  # (no target outside [0, V) whichever ignore_index a rank passes)
    w = class_weights(torch.float32)[rank * 11 : rank * 11 + 11 + rank]
    xl, wl, bl, tl = lce_problem(torch.float32)
    wl, bl = wl[rank * 11 : rank * 11 + 11 + rank], bl[rank * 11 : rank * 11 + 11 + rank]
    r = rank
    ce = fsd.cross_entropy
    lce = fsd.linear_cross_entropy
    return [
        ("cross_entropy", "rows", lambda: ce(x[: M - r], t[: M - r])),
        ("cross_entropy", "dtype", lambda: ce(x.double() if r else x, t)),
        ("cross_entropy", "reduction", lambda: ce(x, t, reduction="sum" if r else "mean")),
        ("cross_entropy", "label_smoothing", lambda: ce(x, t, label_smoothing=EPS * r)),
        ("cross_entropy", "softcap", lambda: ce(x, t, softcap=CAP if r else None)),
        ("cross_entropy", "z_loss", lambda: ce(x, t, z_loss=ZL * r)),
        ("cross_entropy", "ignore_index", lambda: ce(x, kept, ignore_index=7 if r else -100)),
        ("cross_entropy", "class_weight", lambda: ce(x, t, class_weight=w if r else None)),
        ("cross_entropy", "targets permuted", lambda: ce(x, t.roll(r))),
        ("cross_entropy", "an ignored row", lambda: ce(x, torch.where(torch.arange(M) == 0, -100 if r else 0, t))),
        ("cross_entropy", "targets int32", lambda: ce(x, kept.int() if r else torch.where(kept == 3, 4, kept))),
        ("cross_entropy", "targets moved +1 -2 +1", lambda: ce(x, kept + _moved(M, r, (1, -2, 1)))),
        ("cross_entropy", "targets moved +1 -1 -1 +1", lambda: ce(x, kept + _moved(M, r, (1, -1, -1, 1)))),
        ("linear_cross_entropy", "rows", lambda: lce(xl[: N - r], wl, tl[: N - r], bl)),
        ("linear_cross_entropy", "dtype", lambda: lce(xl.double(), wl.double(), tl) if r else lce(xl, wl, tl)),
        ("linear_cross_entropy", "softcap", lambda: lce(xl, wl, tl, bl, softcap=CAP if r else None)),
        ("linear_cross_entropy", "label_smoothing", lambda: lce(xl, wl, tl, bl, label_smoothing=EPS * r)),
        ("linear_cross_entropy", "class_weight", lambda: lce(xl, wl, tl, bl, class_weight=w if r else None)),
        ("linear_cross_entropy", "reduction", lambda: lce(xl, wl, tl, bl, reduction="none" if r else "sum")),
        ("linear_cross_entropy", "targets", lambda: lce(xl, wl, torch.where(torch.arange(N) == N - 1, r, tl), bl)),
        ("linear_cross_entropy", "x", lambda: lce(xl.roll(r, 0), wl, tl, bl)),  # (another rank's sequence shard)
        ("linear_cross_entropy", "x another draw", lambda: lce(xl + r * torch.randn(xl.shape), wl, tl, bl)),
        ("softmax", "dtype", lambda: fsd.softmax(x.double() if r else x)),
        # x's gradient wanted on one rank only: its backward's all-reduce would wait for the other (a hang)
        ("softmax", "requires grad", lambda: fsd.softmax(x.detach().requires_grad_(r == 0))),
        ("cross_entropy", "requires grad", lambda: ce(x.detach().requires_grad_(r == 0), t)),
        ("linear_cross_entropy", "x requires grad", lambda: lce(xl.detach().requires_grad_(r == 0), wl, tl, bl)),
        ("linear_cross_entropy", "no_grad on one rank", lambda: _grad_mode(r == 0, lce, xl.requires_grad_(), wl, tl)),
    ]


def _grad_mode(on: bool, fn, *args):
    with torch.set_grad_enabled(on):
        return fn(*args)


def _drifted(x: torch.Tensor, r: int, ulps: int = 3) -> torch.Tensor:
    """x with every element ``ulps`` ulps higher on rank 1 (replicated weights are known to drift so across
    tensor-parallel ranks)."""
    x = x.clone()
    if r:
        x.view({4: torch.int32, 8: torch.int64}[x.element_size()]).add_(ulps)
    return x


def _moved(m: int, r: int, d: tuple) -> torch.Tensor:
    """Rank 1's targets moved by d on rows 3 onwards, rank 0's not: differences whose sum and whose sum
    weighted by the row are 0 (a digest whose row weights are affine in the row cannot see them)."""
    out = torch.zeros(m, dtype=torch.int64)
    if r:
        out[3 : 3 + len(d)] = torch.tensor(d)
    return out


def _record(out_dir, rank, results):
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))


def _run_ranks(tmp_path, monkeypatch, fn, **spawn) -> list[dict]:
    """fn on 2 gloo ranks: what each recorded (_record), printed when the test fails (up to a hang)."""
    out = tmp_path / "out"
    out.mkdir()
    try:
        spawn_gloo(tmp_path, monkeypatch, fn, 2, out, **spawn)
    finally:
        got = [json.loads(p.read_text()) if p.exists() else {} for p in (out / "rank0.json", out / "rank1.json")]
        print(json.dumps(got, indent=1))
    return got


def _outcomes(cases, rank, out_dir, after=None) -> dict:
    """Each case's outcome ("returned", or the error it raised), recorded after each case (a hang shows
    where); ``after`` called after each."""
    results = {}
    for fn, case, call in cases:
        try:
            call()
            results[f"{fn} {case}"] = "returned"
        except Exception as e:  # noqa: BLE001 (recorded, compared across ranks by the test)
            results[f"{fn} {case}"] = f"{type(e).__name__}: {e}"
        _record(out_dir, rank, results)
        if after is not None:
            after()
    return results


def _errors(rank, world, out_dir):
    import fastsoftmax.distributed as fsd

    results = _outcomes(_disagreements(rank), rank, out_dir)
    # a target outside [0, V) that is not ignore_index: IndexError on every rank
    lo, hi = rank * 11, rank * 11 + 11 + rank
    x = ce_logits(torch.float32, masked=False)[:, lo:hi]
    xl, wl, bl, tl = lce_problem(torch.float32)
    for case, bad in (("V", V), ("-5", -5)):
        t = targets()
        t[0] = bad
        for fn, call in (
            ("cross_entropy", lambda t=t: fsd.cross_entropy(x, t)),
            ("linear_cross_entropy", lambda t=t: fsd.linear_cross_entropy(xl[:M], wl[lo:hi], t, bl[lo:hi])),
        ):
            try:
                call()
                results[f"{fn} target {case}"] = "returned"
            except Exception as e:  # noqa: BLE001
                results[f"{fn} target {case}"] = f"{type(e).__name__}: {e}"
            _record(out_dir, rank, results)
    # different memory= on the ranks: chunks that differ may not desynchronise the collectives
    x64, w64, b64, t64 = lce_problem(torch.float64)
    try:
        got = fsd.linear_cross_entropy(x64, w64[lo:hi], t64, b64[lo:hi], memory=100 if rank else 10_000)
        ref = F.cross_entropy(F.linear(x64, w64, b64), t64)
        results["memory"] = "right" if torch.allclose(got, ref, rtol=1e-10, atol=1e-12) else f"wrong: {got} {ref}"
    except Exception as e:  # noqa: BLE001
        results["memory"] = f"{type(e).__name__}: {e}"
    _record(out_dir, rank, results)
    # x alike on every rank, with NaN in one row, or a few ulps apart: the ranks agree
    xn = xl.clone()
    xn[2, 3] = float("nan")
    for case, xr in (("x with NaN", xn), ("x drifted", _drifted(xl, rank))):
        try:
            got = fsd.linear_cross_entropy(xr, wl[lo:hi], tl, bl[lo:hi], reduction="none")
            results[case] = f"returned, NaN rows {got.isnan().nonzero().flatten().tolist()}"
        except Exception as e:  # noqa: BLE001
            results[case] = f"{type(e).__name__}: {e}"
        _record(out_dir, rank, results)
    _double_backward(fsd, rank, lo, hi)
    results["double backward"] = "refused"
    _record(out_dir, rank, results)


def _double_backward(fsd, rank, lo, hi):
    """create_graph=True through each backward: NotImplementedError naming double backward, on every rank
    (at the first backward, or at the second)."""
    x = ce_logits(torch.float64, masked=False)[:, lo:hi]
    t = targets()
    xl, wl, bl, tl = lce_problem(torch.float64)
    calls = [
        ("cross_entropy", lambda a: fsd.cross_entropy(a, t), x),
        ("cross_entropy options", lambda a: fsd.cross_entropy(a, t, softcap=CAP, label_smoothing=EPS, z_loss=ZL), x),
        ("softmax", lambda a: (fsd.softmax(a) * torch.arange(hi - lo)).sum(), x),
        ("log_softmax", lambda a: (fsd.log_softmax(a) * torch.arange(hi - lo)).sum(), x),
        ("linear_cross_entropy x", lambda a: fsd.linear_cross_entropy(a, wl[lo:hi], tl, bl[lo:hi]), xl),
        ("linear_cross_entropy W", lambda a: fsd.linear_cross_entropy(xl, a, tl, bl[lo:hi]), wl[lo:hi]),
    ]
    for name, f, a in calls:
        a = a.clone().requires_grad_()
        try:
            (g,) = torch.autograd.grad(f(a), a, create_graph=True)
            torch.autograd.grad((g * g).sum(), a)
        except NotImplementedError as e:
            assert "double backward" in str(e), (name, str(e))
        else:
            raise AssertionError(f"{name}: create_graph=True gave a second derivative")
        dist.barrier()  # (every rank past this case before the next one's collectives)


def test_disagreeing_ranks_bad_targets_double_backward(tmp_path, monkeypatch):
    """2 processes whose rows, dtypes or options differ, case by case (cross_entropy, linear_cross_entropy,
    softmax): every rank raises the same ValueError, and no case hangs; a target outside [0, V) raises
    IndexError on every rank; ranks passing different memory= agree on the right loss (or raise the same
    error); create_graph=True through any backward raises NotImplementedError (double backward)."""
    got = _run_ranks(tmp_path, monkeypatch, _errors)
    r0, r1 = got
    assert r0.keys() == r1.keys(), (r0, r1)
    for case in r0:
        assert r0[case] == r1[case], f"{case}: rank 0 {r0[case]!r}, rank 1 {r1[case]!r}"
        fn = case.split()[0]
        if " target " in case:
            assert r0[case].startswith("IndexError: "), (case, r0[case])
        elif case in ("x with NaN", "x drifted"):
            assert r0[case] == ("returned, NaN rows [2]" if "NaN" in case else "returned, NaN rows []"), r0[case]
        elif case == "memory":
            assert r0[case] == "right" or r0[case].startswith("ValueError: distributed."), r0[case]
        elif case != "double backward":
            prefix = f"ValueError: distributed.{fn}: the ranks must pass shards of the same rows and dtype"
            assert r0[case].startswith(prefix), (case, r0[case])
    assert r0.get("double backward") == "refused", r0


# ---- an argument check that fails on one rank --------------------------------------------------------------


def _one_rank_fails(rank):
    """(function, case, call): rank 1's arguments fail the local checks, rank 0's pass."""
    import fastsoftmax.distributed as fsd

    bad = rank == 1
    x = ce_logits(torch.float32, masked=False)[:, rank * 11 : rank * 11 + 11 + rank]
    t = targets()
    xl, wl, bl, tl = lce_problem(torch.float32)
    wl, bl = wl[rank * 11 : rank * 11 + 11 + rank], bl[rank * 11 : rank * 11 + 11 + rank]
    ce, lce = fsd.cross_entropy, fsd.linear_cross_entropy
    return [
        ("cross_entropy", "softcap", lambda: ce(x, t, softcap=-1.0 if bad else None)),
        ("cross_entropy", "label_smoothing", lambda: ce(x, t, label_smoothing=1.5 if bad else 0.0)),
        ("cross_entropy", "logits dtype", lambda: ce(x.long() if bad else x, t)),
        ("cross_entropy", "target dtype", lambda: ce(x, t.float() if bad else t)),
        ("cross_entropy", "logits not a tensor", lambda: ce(x.tolist() if bad else x, t)),
        ("softmax", "dtype", lambda: fsd.softmax(x, dtype=torch.int64 if bad else None)),
        ("softmax", "float8 logits", lambda: fsd.softmax(x.to(torch.float8_e4m3fn) if bad else x)),
        ("log_softmax", "backend", lambda: fsd.log_softmax(x, backend="cuda" if bad else "auto")),
        ("linear_cross_entropy", "memory", lambda: lce(xl, wl, tl, bl, memory=0 if bad else None)),
        ("linear_cross_entropy", "weight", lambda: lce(xl, wl[:, 1:] if bad else wl, tl, bl)),
        ("linear_cross_entropy", "z_loss", lambda: lce(xl, wl, tl, bl, z_loss=-1.0 if bad else 0.0)),
        ("softmax", "meta x", lambda: fsd.softmax(x.to("meta") if bad else x)),
        ("cross_entropy", "meta x", lambda: ce(x.to("meta") if bad else x, t)),
    ]


def _failing_checks(rank, world, out_dir):
    # (a barrier after each case: a rank left waiting in a collective fails there, after the group's timeout)
    _outcomes(_one_rank_fails(rank), rank, out_dir, dist.barrier)


def test_a_check_failing_on_one_rank_raises_on_every_rank(tmp_path, monkeypatch):
    """Rank 1's arguments fail a local check (an option, a dtype, a tensor that is not one, memory=, the
    weight's shape), rank 0's pass: rank 1 raises its own error and rank 0 a ValueError naming rank 1, in
    every case and in step (a regression left rank 0 waiting in the first collective: the group's 20 s
    timeout and the spawn's deadline turn a hang into a failure)."""
    got = _run_ranks(tmp_path, monkeypatch, _failing_checks, timeout_s=20, deadline_s=240)
    r0, r1 = got
    cases = [f"{fn} {case}" for fn, case, _ in _one_rank_fails(1)]
    assert list(r0) == list(r1) == cases, (r0, r1)
    own = {"softcap": "softcap", "label_smoothing": "label_smoothing", "logits dtype": "floating-point",
           "target dtype": "integer dtype", "logits not a tensor": "torch.Tensor", "dtype": "dtype must be None",
           "backend": "backend", "float8 logits": "floating-point", "memory": "memory", "weight": "weight",
           "z_loss": "z_loss", "meta x": "meta"}  # fmt: skip
    for key in cases:
        fn, case = key.split(" ", 1)
        kinds = ("NotImplementedError",) if case == "meta x" else ("TypeError", "ValueError")
        assert r1[key].split(":")[0] in kinds and own[case] in r1[key], (key, r1[key])
        assert f"distributed.{fn}" in r1[key], (key, r1[key])
        want = f"ValueError: distributed.{fn}: rank 1's arguments failed its checks"
        assert r0[key].startswith(want), (key, r0[key])


def _triton_without_interpreter(rank, world, out_dir):
    import fastsoftmax.distributed as fsd

    x = ce_logits(torch.float32, masked=False)[:, : 0 if rank == 0 else V]  # (rank 0: a slice of no classes)
    cases = [
        ("softmax", "backend triton", lambda: fsd.softmax(x, backend="triton")),
        ("cross_entropy", "backend triton", lambda: fsd.cross_entropy(x, targets(), backend="triton")),
    ]
    _outcomes(cases, rank, out_dir, dist.barrier)


def test_a_backend_that_cannot_run_is_refused_on_every_rank(tmp_path, monkeypatch):
    """backend='triton' on CPU tensors without Triton's interpreter, rank 0's slice without classes: both
    ranks refuse it before the first collective, each with the backend's error (a regression: whether the
    backend runs the slice was asked only of slices with classes, after that collective, and rank 0 waited
    in the second)."""
    got = _run_ranks(tmp_path, monkeypatch, _triton_without_interpreter, timeout_s=20, deadline_s=120)
    for r, results in enumerate(got):
        assert list(results) == ["softmax backend triton", "cross_entropy backend triton"], results
        for key, text in results.items():
            fn = key.split()[0]
            assert text.startswith(f"RuntimeError: distributed.{fn}: backend='triton' cannot run"), (r, text)


# ---- a dispatch mode on one rank -------------------------------------------------------------------------------


def _under_a_mode(rank, world, out_dir):
    """Each function forward and backward, rank 0 under FlopCounterMode (a dispatch mode that runs every op
    it sees), rank 1 not; then both under it. Each result against the single-process fs call on the full
    logits in float64."""
    from torch.utils.flop_counter import FlopCounterMode

    import fastsoftmax as fs
    import fastsoftmax.distributed as fsd

    lo, hi = rank * 11, rank * 11 + 11 + rank
    full, t = ce_logits(torch.float64, masked=False), targets()
    xl, wl, bl, tl = lce_problem(torch.float64)

    def check(fsd_call, fs_call, sliced):
        whole = (wl if sliced == "rows" else full).clone().requires_grad_()
        part = (lambda a: a[lo:hi]) if sliced == "rows" else (lambda a: a[:, lo:hi])
        a = part(whole).detach().requires_grad_()
        out, ref = fsd_call(a), fs_call(whole)
        dref = torch.linspace(-1, 1, ref.numel(), dtype=ref.dtype).reshape(ref.shape)  # (softmax: a rank its columns)
        (da,) = torch.autograd.grad(out, a, part(dref) if out.shape != ref.shape else dref)
        (dwhole,) = torch.autograd.grad(ref, whole, dref)
        want = part(ref) if out.shape != ref.shape else ref
        close = dict(rtol=1e-10, atol=1e-12)
        if torch.allclose(out, want, **close) and torch.allclose(da, part(dwhole), **close):
            return "right"
        return f"wrong: {(out - want).abs().max()} {(da - part(dwhole)).abs().max()}"

    cases = {
        "softmax": (fsd.softmax, fs.softmax, "cols"),
        "log_softmax": (fsd.log_softmax, fs.log_softmax, "cols"),
        "cross_entropy": (lambda a: fsd.cross_entropy(a, t), lambda a: fs.cross_entropy(a, t), "cols"),
        "linear_cross_entropy": (
            lambda a: fsd.linear_cross_entropy(xl, a, tl, bl[lo:hi]),
            lambda a: fs.linear_cross_entropy(xl, a, tl, bl),
            "rows",
        ),
    }
    results = {}
    for who in ("rank 0", "both"):
        for name, (fsd_call, fs_call, sliced) in cases.items():
            mode = FlopCounterMode(display=False) if rank == 0 or who == "both" else contextlib.nullcontext()
            try:
                with mode:
                    results[f"{who} {name}"] = check(fsd_call, fs_call, sliced)
            except Exception as e:  # noqa: BLE001 (recorded, compared by the test)
                results[f"{who} {name}"] = f"{type(e).__name__}: {e}"
            _record(out_dir, rank, results)
            dist.barrier()


def test_a_dispatch_mode_on_one_rank_runs_on_every_rank(tmp_path, monkeypatch):
    """A dispatch mode that runs the ops it sees (FlopCounterMode) on rank 0 alone, then on both: every
    function runs, forward and backward, and gives the single-process result (a regression: the rank under
    the mode refused the call before the first collective and the other waited there; fake tensors are
    still refused, test_distributed.py)."""
    got = _run_ranks(tmp_path, monkeypatch, _under_a_mode, timeout_s=20, deadline_s=240)
    names = ("softmax", "log_softmax", "cross_entropy", "linear_cross_entropy")
    cases = [f"{who} {n}" for who in ("rank 0", "both") for n in names]
    for results in got:
        assert list(results) == cases and set(results.values()) == {"right"}, results


# ---- a rank outside the group ---------------------------------------------------------------------------------


def _outside_the_group(rank, world, out_dir):
    """The group holds rank 1 alone: rank 0 calls each function with it, rank 1 too (its slice the whole
    vocabulary), and rank 1's results against the single-process fs call in float64."""
    import fastsoftmax as fs
    import fastsoftmax.distributed as fsd

    group = dist.new_group([1])  # (every rank makes the group)
    x, t = ce_logits(torch.float64, masked=False), targets()
    xl, wl, bl, tl = lce_problem(torch.float64)
    cases = {
        "softmax": (lambda: fsd.softmax(x, group=group), lambda: fs.softmax(x)),
        "log_softmax": (lambda: fsd.log_softmax(x, group=group), lambda: fs.log_softmax(x)),
        "cross_entropy": (lambda: fsd.cross_entropy(x, t, group=group), lambda: fs.cross_entropy(x, t)),
        "linear_cross_entropy": (
            lambda: fsd.linear_cross_entropy(xl, wl, tl, bl, group=group),
            lambda: fs.linear_cross_entropy(xl, wl, tl, bl),
        ),
    }
    results = {}
    for name, (fsd_call, fs_call) in cases.items():
        try:
            out = fsd_call()
            results[name] = "right" if torch.allclose(out, fs_call(), rtol=1e-10, atol=1e-12) else "wrong"
        except Exception as e:  # noqa: BLE001 (recorded, checked by the test)
            results[name] = f"{type(e).__name__}: {e}"
        _record(out_dir, rank, results)


def test_a_rank_outside_the_group_is_refused(tmp_path, monkeypatch):
    """A rank that is not in ``group`` gets a ValueError saying so before any collective (it raised
    "Trying to create tensor with negative dimension -71": the group's size is -1 there); the group's own
    rank runs as usual."""
    r0, r1 = _run_ranks(tmp_path, monkeypatch, _outside_the_group, timeout_s=20, deadline_s=120)
    names = ["softmax", "log_softmax", "cross_entropy", "linear_cross_entropy"]
    assert list(r0) == list(r1) == names, (r0, r1)
    for name in names:
        assert r0[name].startswith(f"ValueError: distributed.{name}: this rank (0) is not in the group"), r0[name]
        assert r1[name] == "right", r1[name]
