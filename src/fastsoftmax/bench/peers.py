"""The implementations `fastsoftmax bench` times: fastsoftmax per backend and its peers (torch eager,
torch.compile, Liger-Kernel, QuACK), each behind one adapter. Peers are imported when built, never at import;
one that cannot be imported here raises then and is recorded as unsupported (dev/peers.sh packs them for
the device: dev/README.md).

An adapter is a pair (fwd(x) -> fn, bwd(dy, y) -> fn), each fn a no-argument callable: what is timed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Thunk = Callable[[], object]
Adapter = tuple[Callable[[torch.Tensor], Thunk], Callable[[torch.Tensor, torch.Tensor], Thunk]]

IMPLS = ("fastsoftmax", "fastsoftmax-triton", "fastsoftmax-cuda", "torch", "torch.compile", "liger", "quack", "copy")
PEERS = ("torch", "torch.compile", "liger", "quack")
MASKED_IMPLS = ("fastsoftmax", "fastsoftmax-triton", "torch", "torch.compile")
CE_IMPLS = ("fastsoftmax", "torch", "torch.compile", "liger", "quack")


def _fastsoftmax(backend: str) -> Adapter:
    import fastsoftmax as fs

    def fwd(x):
        return lambda: fs.softmax(x, backend=backend)

    def bwd(dy, y):
        return lambda: fs.softmax_backward(dy, y, backend=backend)

    return fwd, bwd


def _torch() -> Adapter:
    def fwd(x):
        return lambda: torch.softmax(x, -1)

    def bwd(dy, y):
        return lambda: torch.ops.aten._softmax_backward_data(dy, y, -1, y.dtype)

    return fwd, bwd


def _torch_compile() -> Adapter:
    f = torch.compile(lambda x: torch.softmax(x, -1), dynamic=False)
    b = torch.compile(
        lambda dy, y: (y.float() * (dy.float() - (y.float() * dy.float()).sum(-1, keepdim=True))).to(y.dtype),
        dynamic=False,
    )

    def fwd(x):
        return lambda: f(x)

    def bwd(dy, y):
        return lambda: b(dy, y)

    return fwd, bwd


def _liger() -> Adapter:
    from liger_kernel.ops.softmax import _softmax_backward, _softmax_forward

    def fwd(x):
        return lambda: _softmax_forward(x)[0]

    def bwd(dy, y):
        _, block, warps, multi = _softmax_forward(y)  # the launch settings its forward picks for this N
        return lambda: _softmax_backward(dy, y, block, warps, multi)

    return fwd, bwd


def _quack() -> Adapter:
    from quack.softmax import softmax_bwd, softmax_fwd

    def fwd(x):
        return lambda: softmax_fwd(x)

    def bwd(dy, y):
        return lambda: softmax_bwd(dy, y)

    return fwd, bwd


def _same_bytes() -> Adapter:
    """Not a softmax: an elementwise op moving the pass's bytes (forward: x copied, backward: y + dy), the
    speed of light of a problem this size under the same timing (few rows: the launch and the latency of one
    wave, which the 1 GiB copy_gbps does not show). Not checked against the oracle."""

    def fwd(x):
        out = torch.empty_like(x)
        return lambda: out.copy_(x)

    def bwd(dy, y):
        out = torch.empty_like(y)
        return lambda: torch.add(y, dy, out=out)

    return fwd, bwd


# name -> (builder of its adapter, the fastsoftmax backend it forces or None)
BUILDERS: dict[str, tuple[Callable[[], Adapter], str | None]] = {
    "fastsoftmax": (lambda: _fastsoftmax("auto"), "auto"),
    "fastsoftmax-triton": (lambda: _fastsoftmax("triton"), "triton"),
    "fastsoftmax-cuda": (lambda: _fastsoftmax("cuda"), "cuda"),
    "torch": (_torch, None),
    "torch.compile": (_torch_compile, None),
    "liger": (_liger, None),
    "quack": (_quack, None),
    "copy": (_same_bytes, None),
}
SAME_BYTES = "copy"  # BUILDERS' reference that is not a softmax


# ---- --masked: softmax(scale * x + mask) -------------------------------------------------------------------


def _torch_masked(pad, keep, scale: float, compiled: bool):
    """What an attention layer does with torch ops: scale, masked_fill, softmax; its autograd backward.
    ``keep``: the causal (S, S) mask, built once outside the timed calls (or None)."""

    def fwd(x):
        z = x * scale
        if pad is not None:
            z = z.masked_fill(~pad, float("-inf"))
        if keep is not None:
            z = z.masked_fill(~keep, float("-inf"))
        return torch.softmax(z, -1)

    def bwd(dy, y):
        dz = torch.ops.aten._softmax_backward_data(dy, y, -1, y.dtype)
        if keep is not None:
            dz = dz.masked_fill(~keep, 0)
        if pad is not None:
            dz = dz.masked_fill(~pad, 0)
        return dz * scale

    if compiled:
        fwd, bwd = torch.compile(fwd, dynamic=False), torch.compile(bwd, dynamic=False)
    return fwd, bwd


def masked_fn(
    name: str,
    pass_: str,
    x: torch.Tensor,
    y: torch.Tensor,
    dy: torch.Tensor,
    pad: torch.Tensor | None,
    causal: bool,
    scale: float,
) -> Thunk:
    """The no-argument callable an implementation runs for one masked problem."""
    import fastsoftmax as fs

    if name.startswith("fastsoftmax"):
        be = BUILDERS[name][1]
        if pass_ == "fwd":
            return lambda: fs.softmax(x, mask=pad, scale=scale, causal=causal, backend=be)
        return lambda: fs.softmax_backward(dy, y, mask=pad, scale=scale, causal=causal, backend=be)
    from ..core.masking import causal_keep

    fwd, bwd = _torch_masked(pad, causal_keep(x) if causal else None, scale, name == "torch.compile")
    return (lambda: fwd(x)) if pass_ == "fwd" else (lambda: bwd(dy, y))


# ---- --ce: cross-entropy -------------------------------------------------------------------------------------


def ce_builder(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """loss(x, t) -> scalar mean loss, differentiable, for one implementation."""
    import torch.nn.functional as F

    import fastsoftmax as fs

    if name == "fastsoftmax":
        return lambda x, t: fs.cross_entropy(x, t)
    if name == "torch":
        return lambda x, t: F.cross_entropy(x, t)
    if name == "torch.compile":
        return torch.compile(lambda x, t: F.cross_entropy(x, t), dynamic=False)
    if name == "liger":
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction

        return lambda x, t: LigerCrossEntropyFunction.apply(
            x, t, None, -100, 0.0, 0.0, "mean", None, False, False, False
        )[0]
    if name == "quack":
        from quack.cross_entropy import cross_entropy

        return lambda x, t: cross_entropy(x, t, reduction="mean")
    raise ValueError(name)
