"""One candidate of a dev benchmark's row: run it once forced (outputs poisoned with NaN first) and checked
against the float64 oracle, then timed forced; the cell text "tag=GB/s[cCTAs per row]", "tag=WRONG" or
"tag=n/a(why)". Shared by bench_staged.py and bench_few.py (imported from dev/, the scripts' folder)."""

import functools

import torch

from fastsoftmax import heuristics


def forced_cell(tag, path, backend, run, args, check, gbps_of) -> str:
    """``run(*args, backend=backend)`` under heuristics.force(path=path); ``check(out)`` returns (error,
    problem or None); ``gbps_of(fn)`` times a no-argument callable."""
    try:
        with heuristics.force(poison=True, path=path):
            out = run(*args, backend=backend)
            plan = heuristics.last_plan()
            _, problem = check(out)
        if problem:
            return f"{tag}=WRONG({problem[:60]})"
        with heuristics.force(path=path):
            return f"{tag}={gbps_of(functools.partial(run, *args, backend=backend)):.0f}[c{plan.splits}]"
    except (ValueError, RuntimeError) as e:
        torch.cuda.synchronize()
        return f"{tag}=n/a({str(e)[:40]})"
