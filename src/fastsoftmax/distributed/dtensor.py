"""DTensor inputs (torch.distributed.tensor) to fs.softmax, fs.log_softmax, fs.cross_entropy and
fs.linear_cross_entropy: logits sharded on the class dim (the last), or an LM head's weight sharded on its
rows (the classes), on one dim of the device mesh and replicated on the others, run fastsoftmax.distributed
over that mesh dim's process group, as torch.distributed.tensor.parallel.loss_parallel does for
F.cross_entropy. Losses come back as DTensors replicated on the mesh, softmax with the logits' placements.
Targets, x (the LM head's input) and class weights may be plain tensors or replicated DTensors; full class
weights (V,) are cut to the rank's slice (class_weight may also be sharded as the logits are). Any other
placement raises NotImplementedError."""

from __future__ import annotations

from ..core import compose


def _class_group(fn: str, dt, dim: int):
    """(the mesh dim's process group, its size, this rank's coordinate on it) of the one mesh dim that shards
    ``dim`` of dt; the others must replicate."""
    from torch.distributed.tensor import Replicate, Shard

    want = dim % dt.ndim
    sharded = [i for i, p in enumerate(dt.placements) if isinstance(p, Shard) and p.dim % dt.ndim == want]
    others = [p for i, p in enumerate(dt.placements) if i not in sharded and not isinstance(p, Replicate)]
    if len(sharded) != 1 or others or type(dt.placements[sharded[0]]) is not Shard:
        raise NotImplementedError(
            f"{fn}: a DTensor runs the distributed path when dim {want} is Shard on one mesh dim and every other "
            f"mesh dim is Replicate; got placements {dt.placements}"
        )
    mesh_dim = sharded[0]
    return dt.device_mesh.get_group(mesh_dim), dt.device_mesh.size(mesh_dim), dt.device_mesh.get_local_rank(mesh_dim)


def _replicated(fn: str, name: str, t):
    """A plain tensor, or a replicated DTensor's local tensor (which autograd carries back)."""
    if t is None or not compose.is_dtensor(t):
        return t
    from torch.distributed.tensor import Replicate

    if not all(isinstance(p, Replicate) for p in t.placements):
        raise NotImplementedError(f"{fn}: {name} must be a plain tensor or a replicated DTensor, got {t.placements}")
    return t.to_local()


def _slice(fn: str, name: str, t, v: int, parts: int, rank: int):
    """The rank's slice of a (V,) tensor: a plain or replicated tensor cut as Shard cuts (torch.chunk's
    sizes), or a DTensor sharded on its one dim (as the classes are)."""
    if t is None:
        return None
    if compose.is_dtensor(t) and any(not p.is_replicate() for p in t.placements):
        _class_group(fn, t, 0)  # (sharded on its one dim, replicated elsewhere)
        return t.to_local()
    t = _replicated(fn, name, t)
    if t.shape != (v,):
        return t  # (fastsoftmax.distributed names the shape it wants)
    size = -(-v // parts)
    start = min(rank * size, v)
    return t[start : min(start + size, v)]


def _replicate(t, mesh):
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)


def softmax(x, dim: int, log: bool, dtype, backend: str, fn: str):
    """fs.softmax / fs.log_softmax of a DTensor sharded on its last dim (dim, checked and non-negative, must
    name it)."""
    from torch.distributed.tensor import DTensor

    if dim != max(x.ndim, 1) - 1:
        raise NotImplementedError(f"{fn}: a DTensor sharded on the classes runs along its last dim, got dim={dim}")
    group, _, _ = _class_group(fn, x, -1)
    from .. import distributed

    run = distributed.log_softmax if log else distributed.softmax
    y = run(x.to_local(), group=group, dtype=dtype, backend=backend)
    return DTensor.from_local(y, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())


def cross_entropy(logits, target, class_weight, return_z_loss: bool, **options):
    """fs.cross_entropy of logits sharded on the class dim: a replicated DTensor loss (and z-loss)."""
    from .. import distributed

    fn = "cross_entropy"
    group, parts, rank = _class_group(fn, logits, -1)
    t = _replicated(fn, "target", target)
    w = _slice(fn, "class_weight", class_weight, logits.shape[-1], parts, rank)
    out = distributed.cross_entropy(
        logits.to_local(), t, group=group, class_weight=w, return_z_loss=return_z_loss, **options
    )
    mesh = logits.device_mesh
    return tuple(_replicate(o, mesh) for o in out) if return_z_loss else _replicate(out, mesh)


def linear_cross_entropy(x, weight, target, bias, class_weight, return_z_loss: bool, **options):
    """fs.linear_cross_entropy with the weight (and bias) sharded on the classes: a replicated DTensor loss."""
    from .. import distributed

    fn = "linear_cross_entropy"
    group, parts, rank = _class_group(fn, weight, 0)
    v = weight.shape[0]
    b = None
    if bias is not None:
        b = bias.to_local() if compose.is_dtensor(bias) and bias.placements == weight.placements else None
        if b is None:
            raise NotImplementedError(f"{fn}: with a sharded weight the bias must be a DTensor sharded as it is")
    xl, t = _replicated(fn, "x", x), _replicated(fn, "target", target)
    w = _slice(fn, "class_weight", class_weight, v, parts, rank)
    out = distributed.linear_cross_entropy(
        xl, weight.to_local(), t, b, group=group, class_weight=w, return_z_loss=return_z_loss, **options
    )
    mesh = weight.device_mesh
    return tuple(_replicate(o, mesh) for o in out) if return_z_loss else _replicate(out, mesh)
