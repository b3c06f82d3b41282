"""Every forward path, forced, against the float64 oracle: odd and prime N, special-value rows, outliers,
outputs poisoned with NaN before each launch, non-contiguous layouts, dtype= outputs, and the per-row
logsumexp. Runs the Triton kernels in the interpreter on CPU, compiled with --device cuda."""

import pytest
import torch
from helpers import DTYPES, assert_close, forward, random_logits, special_rows

import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.core.reference import oracle, oracle_lse

FNS = {False: fs.softmax, True: fs.log_softmax}


def run(x, dim=-1, log=False, dtype=None, backend="triton", **force):
    """Call with outputs poisoned, optionally forcing a path; return (y, plan that ran)."""
    with heuristics.force(poison=True, **force):
        y = FNS[log](x, dim, dtype=dtype, backend=backend)
    return y, heuristics.last_plan()


# (n, forced path, block_n): rowblock whole-row tiles; online and split with chunks smaller than the row
# so loops run several times, the last chunk is partial, and split rows have several segments.
CASES = [
    (1, "rowblock", None),
    (7, "rowblock", None),
    (64, "rowblock", None),
    (513, "rowblock", None),
    (1000, "rowblock", None),
    (7, "online", 4),
    (513, "online", 64),
    (1000, "online", 128),
    (2053, "online", 256),
    (7, "split", 4),
    (1000, "split", 128),
    (2053, "split", 256),
]


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,path,block", CASES)
def test_paths_random_and_special(device, n, path, block, dtype, log):
    gen = torch.Generator().manual_seed(n * 7 + len(path))
    x = torch.cat([random_logits((5, n), dtype, gen), special_rows(n, dtype, gen)]).to(device)
    force = {"path": path} | ({"block_n": block} if block else {})
    y, plan = run(x, log=log, **force)
    assert (plan.backend, plan.path) == ("triton", path)
    assert plan.splits == (-(-n // block) if path == "split" else 1)  # 14 rows: one segment per chunk
    # Rows of >= 4 vectors that are not 16-byte aligned take the aligned-body + edges code.
    assert plan.edges == (n % 16 != 0 and n >= 4 * (16 // x.element_size()))
    assert_close(y, x, -1, log)


@pytest.mark.parametrize("path", ["rowblock", "online", "split"])
def test_rows_per_program_partial_last_tile(device, path):
    # 11 rows, 4 per program: the last program owns 3 real rows and one that must not be touched.
    gen = torch.Generator().manual_seed(1)
    x = random_logits((11, 100), torch.float32, gen).to(device)
    y, plan = run(x, path=path, rows=4, block_n=128 if path == "rowblock" else 32)
    assert plan.rows == 4
    assert_close(y, x, -1, False)


def test_rowblock_refuses_short_block(device):
    """A rowblock tile must hold the row's 16-byte-aligned body (the edge code holds the rest): N = 513 fits
    a 512-wide tile, a strided row (scalar code) needs all of N."""
    x = torch.randn(2, 100, device=device)
    with pytest.raises(ValueError, match=r"block_n >= N's aligned body \(100 of N=100\)"):
        run(x, path="rowblock", block_n=64)
    gen = torch.Generator().manual_seed(513)
    x = random_logits((3, 513), torch.float32, gen)
    x[:, [0, 1, 2, 512]] = 40.0  # outliers in the edges
    y, plan = run(x.to(device), path="rowblock", block_n=512)
    assert (plan.block_n, plan.vec, plan.edges) == (512, 4, True)
    assert_close(y, x.to(device), -1, False)
    with pytest.raises(ValueError, match=r"aligned body \(512 of N=513\); got 256"):
        run(x.to(device), path="rowblock", block_n=256)
    with pytest.raises(ValueError, match=r"aligned body \(513 of N=513\); got 512"):  # a strided row
        run(x.t().contiguous().t().to(device), path="rowblock", block_n=512)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_logits_are_finite(device, dtype):
    big = 6.0e4 if dtype == torch.float16 else 3.0e3
    x = (torch.tensor([[big, big - 1, big - 2, -big]])).to(dtype).to(device)
    for path in ("rowblock", "online", "split"):
        y, _ = run(x, path=path)
        assert torch.isfinite(y).all()
        assert_close(y, x, -1, False)


LAYOUTS = {
    # name: (make x from a contiguous base, dim, expected plan flags)
    "transposed": (lambda b: b.t(), -1, {"inner": False, "vec": 1}),
    "dim0": (lambda b: b, 0, {"inner": False, "vec": 1}),
    "sliced_cols": (lambda b: b[:, 3:40], -1, {"edges": True}),
    "sliced_rows_step": (lambda b: b[::3], -1, {}),
    "expanded": (lambda b: b[:1].expand(4, -1), -1, {}),
    "expanded_3d": (lambda b: b[:5].unsqueeze(0).expand(3, -1, -1), -1, {"inner": True}),
    "misaligned_start": (lambda b: b.flatten()[1:].view(1, -1)[:, :200].reshape(4, 50), -1, {"edges": True}),
}


@pytest.mark.parametrize("path", ["rowblock", "online", "split"])
@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_non_contiguous(device, name, path, dtype):
    make, dim, flags = LAYOUTS[name]
    gen = torch.Generator().manual_seed(3)
    base = random_logits((24, 64), dtype, gen).to(device)
    x = make(base)
    y, plan = run(x, dim, path=path, **({"block_n": 16} if path != "rowblock" else {}))
    assert plan.path == path
    for k, v in flags.items():
        assert getattr(plan, k) == v, (k, plan)
    assert_close(y, x, dim, False)


@pytest.mark.parametrize("path", ["rowblock", "online", "split"])
@pytest.mark.parametrize(
    "shape,dim",
    [((2, 6, 5, 7), 1), ((3, 4, 5), 1), ((3, 4, 5), 0), ((2, 3, 4, 5), 2), ((1, 9, 1), 1)],
)
def test_any_dim(device, shape, dim, path):
    gen = torch.Generator().manual_seed(4)
    x = random_logits(shape, torch.float32, gen).to(device)
    y, plan = run(x, dim, log=True, path=path)
    assert_close(y, x, dim, True)


def test_channels_last(device):
    gen = torch.Generator().manual_seed(5)
    x = random_logits((2, 20, 5, 3), torch.float32, gen).to(device).to(memory_format=torch.channels_last)
    y, plan = run(x, 1)
    assert y.is_contiguous(memory_format=torch.channels_last)  # output keeps the input's layout
    assert plan.vec == 4 and not plan.inner  # channels dim is contiguous: rows merge into one group
    assert_close(y, x, 1, False)


def test_more_row_groups_than_two_copies_once(device):
    gen = torch.Generator().manual_seed(6)
    x = random_logits((4, 6, 5, 8), torch.float32, gen).to(device)[::2, :, ::2]
    y, plan = run(x, 1)
    assert plan.copied
    assert_close(y, x, 1, False)


@pytest.mark.parametrize(
    "src,out",
    [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.float32),
        (torch.float32, torch.float16),
    ],
)
@pytest.mark.parametrize("log", [False, True])
def test_dtype_out(device, src, out, log):
    gen = torch.Generator().manual_seed(7)
    x = torch.cat([random_logits((3, 300), src, gen), special_rows(300, src, gen)]).to(device)
    y, plan = run(x, log=log, dtype=out)
    assert plan.backend == "triton" and not plan.copied  # written in `out` by the kernel, no extra pass
    assert_close(y, x, -1, log, out_dtype=out)


@pytest.mark.parametrize("path", ["rowblock", "online", "split"])
@pytest.mark.parametrize("shape,dim", [((9, 513), -1), ((3, 40, 5), 1), ((6, 7, 3), 0)])
def test_logsumexp_statistic(device, shape, dim, path):
    gen = torch.Generator().manual_seed(8)
    x = random_logits(shape, torch.float32, gen).to(device)
    x.select(dim, 0).fill_(float("-inf"))  # one element of every row masked
    if dim == -1:
        x[1] = float("-inf")  # a fully masked row: lse = -inf
    with heuristics.force(poison=True, path=path, **({"block_n": 128} if path == "split" else {})):
        y, lse = forward(x, dim, want_lse=True, backend="triton")
    ref = oracle_lse(x, dim).cpu()
    assert lse.shape == ref.shape and lse.dtype == torch.float32
    got = lse.cpu().double()
    assert torch.equal(got.isinf(), ref.isinf())
    fin = ~ref.isinf()
    torch.testing.assert_close(got[fin], ref[fin], rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("path", ["rowblock", "online", "split"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_invariants(device, path, dtype):
    gen = torch.Generator().manual_seed(9)
    x = random_logits((6, 333), dtype, gen).to(device)
    p, _ = run(x, path=path, dtype=torch.float32)
    torch.testing.assert_close(p.sum(-1), torch.ones(6, device=device), rtol=0, atol=2e-6)
    shifted, _ = run((x.float() + 100.0).to(dtype) if dtype == torch.float32 else x, path=path, dtype=torch.float32)
    torch.testing.assert_close(shifted, p, rtol=1e-4, atol=1e-6)  # shift invariance
    logp, _ = run(x, path=path, log=True, dtype=torch.float32)
    torch.testing.assert_close(logp.exp(), p, rtol=1e-5, atol=1e-6)


def test_torch_path_matches_oracle(device):
    gen = torch.Generator().manual_seed(10)
    for dtype in (*DTYPES, torch.float64):
        x = torch.cat([random_logits((4, 129), dtype, gen), special_rows(129, dtype, gen)]).to(device)
        for log in (False, True):
            y, plan = run(x, log=log, backend="torch")
            assert plan.path == "reference"
            if dtype == torch.float64:
                torch.testing.assert_close(y.cpu(), oracle(x, -1, log).cpu(), equal_nan=True)
            else:
                assert_close(y, x, -1, log)
