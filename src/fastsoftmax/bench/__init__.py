"""`fastsoftmax bench`: fastsoftmax against its peers, in one process on one GPU.

suite: the shape suites and the problems timed (checked against the oracle first); peers: the implementations
timed; tuning: the sweep that writes the table backend="auto" reads; report: the result documents' tables,
JSON and plot. Imports run one way: tuning -> suite -> report -> peers. Nothing runs at import: triton,
matplotlib and the peers are imported where they are used.
"""

from .peers import BUILDERS, CE_IMPLS, IMPLS, MASKED_IMPLS
from .report import plot, print_tables, write_json
from .suite import (
    ATTENTION,
    CE_SUITE,
    PEER_SLACK,
    QUICK,
    SUITE,
    default_jobs,
    jobs_for,
    measure,
    run,
    run_ce,
    run_masked,
    warm,
)
from .tuning import tune, tune_shapes

__all__ = [
    "ATTENTION",
    "BUILDERS",
    "CE_IMPLS",
    "CE_SUITE",
    "QUICK",
    "SUITE",
    "IMPLS",
    "MASKED_IMPLS",
    "PEER_SLACK",
    "default_jobs",
    "jobs_for",
    "measure",
    "plot",
    "print_tables",
    "run",
    "run_ce",
    "run_masked",
    "tune",
    "tune_shapes",
    "warm",
    "write_json",
]
