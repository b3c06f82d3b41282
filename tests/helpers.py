"""Test helpers over the library's one reference and one tolerance rule (fastsoftmax.core.reference)."""

from __future__ import annotations

import contextlib
import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from fastsoftmax.core.reference import compare, random_logits, special_rows  # noqa: F401

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
WORST: dict[str, float] = {}  # worst err/tol seen per output dtype, printed at the end of the run


def assert_close(y: torch.Tensor, x: torch.Tensor, dim: int, log: bool, out_dtype=None) -> float:
    """y must match the float64 oracle of x under the library's tolerance rule; returns err/tol."""
    err, problem = compare(y, x, dim, log, out_dtype)
    assert problem is None, problem
    key = str(out_dtype or x.dtype).removeprefix("torch.")
    WORST[key] = max(WORST.get(key, 0.0), err)
    return err


def overflowing_grad_inputs(n: int, seed: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(dy, y) in fp16 whose softmax gradient y·(dy - sum(y·dy)) exceeds fp16's range in most elements (y of
    magnitude up to ~1e4, as a caller may pass any y) and stays finite in some: 3 rows of n."""
    gen = torch.Generator().manual_seed(seed)
    y = (random_logits((3, n), torch.float32, gen) * 40).to(torch.float16)
    dy = torch.randn(3, n, generator=gen).to(torch.float16)
    return dy.to(device), y.to(device)


def forward(x, dim=-1, *, log=False, dtype=None, backend="auto", want_lse=False):
    """(y, logsumexp per row or None): fastsoftmax.softmax.forward, for tests that read the logsumexp the
    kernels write beside y."""
    from fastsoftmax.ops.softmax import forward as api_forward

    return api_forward(x, dim, log=log, dtype=dtype, backend=backend, want_lse=want_lse)


def pass_through_mode():
    """A TorchDispatchMode that runs every op as it comes: a dispatch mode on the stack, nothing else."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    return PassThrough()


@contextlib.contextmanager
def triton_hook(runtime, name: str, hook):
    """hook registered as Triton's launch hook `name` (knobs.runtime.launch_enter_hook / launch_exit_hook) for
    the block: a HookChain's add and remove (Triton 3.5 and newer), or the plain attribute (Triton 3.4, where
    the hook is None or one callable)."""
    chain = getattr(runtime, name)
    if hasattr(chain, "add"):
        chain.add(hook)
        try:
            yield
        finally:
            chain.remove(hook)
        return
    setattr(runtime, name, hook)
    try:
        yield
    finally:
        setattr(runtime, name, chain)


GLOO_TIMEOUT_S = 120  # a collective left waiting this long raises on its rank: a hang becomes an error
DEADLINE_S = 420  # a spawn still running after this is killed and the test fails (a hang)


def _gloo_child(rank, world, init_file, fn, args):
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S),
    )
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn_gloo(tmp_path, monkeypatch, fn, world, *args, interpret=False):
    """fn(rank, world, *args) on ``world`` CPU processes in one gloo group (a file:// store in tmp_path, no
    network ports); fails, the processes killed, after DEADLINE_S. ``interpret``: the children keep
    TRITON_INTERPRET=1 (backend='triton' runs the kernels in Triton's interpreter); else torch ops only."""
    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if os.path.exists("/sys/class/net/lo") and "GLOO_SOCKET_IFNAME" not in os.environ:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # gloo's traffic stays on the loopback interface
    ctx = mp.spawn(_gloo_child, args=(world, str(tmp_path / "store"), fn, args), nprocs=world, join=False)
    end = time.monotonic() + DEADLINE_S
    while not ctx.join(timeout=max(1.0, end - time.monotonic())):
        if time.monotonic() >= end:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join()
            pytest.fail(f"{fn.__name__} on {world} processes: no result after {DEADLINE_S} s (a hang?)")


def ref_loss(logits, target, ignore_index=-100, reduction="mean", eps=0.0, class_weight=None, softcap=None, z_loss=0.0):
    """(loss, z_term) in float64: softcap first, then torch's F.cross_entropy (weight=, label_smoothing=) plus
    z_loss * logsumexp(z)^2 per row not ignored, reduced over the rows not ignored (the mean: by their
    number, not by the weight sum). Differentiable in logits when it is a float64 leaf."""
    v = logits.shape[-1]
    x = logits.double().reshape(-1, v)
    t = target.reshape(-1).long()
    z = softcap * torch.tanh(x / softcap) if softcap is not None else x
    w = class_weight.double() if class_weight is not None else None
    ce = F.cross_entropy(z, t, weight=w, label_smoothing=eps, reduction=reduction, ignore_index=ignore_index)
    keep = t != ignore_index
    zrow = torch.where(keep, z_loss * torch.logsumexp(z, -1).square(), 0.0)
    if reduction == "mean":
        zterm = zrow.sum() / keep.sum()
    elif reduction == "sum":
        zterm = zrow.sum()
    else:
        ce, zrow = ce.reshape(target.shape), zrow.reshape(target.shape)
        zterm = zrow
    return ce + zterm, zterm
