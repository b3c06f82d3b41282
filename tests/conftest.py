"""Tests run on the CPU by default, the Triton kernels in Triton's interpreter; `pytest --device cuda` runs
the same tests on a GPU with compiled kernels. TRITON_INTERPRET must be set before fastsoftmax first
imports its kernels, so it is set here, before any test module runs.

`--full` adds the longest cases on the CPU (FULL_ONLY: each 1.5-95 s in the interpreter on 2 cores), and
`--only-full` runs them alone (`.ci/run`'s step after the README's command); without either they are
deselected, and the default run keeps at least one case of every path, dtype and option they cover. On a
GPU every case runs."""

import os

import pytest


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", choices=["cpu", "cuda"], help="device the tests run on")
    parser.addoption("--full", action="store_true", help="also the longest CPU cases (FULL_ONLY; CI runs them)")
    parser.addoption(
        "--only-full", action="store_true", help="only the longest CPU cases (CI's step after the default)"
    )


def pytest_configure(config):
    # one CPU thread per torch process: xdist's workers (one per core) would otherwise each run a thread per
    # core, and small CPU ops slow down several times over on the cores they share
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if config.getoption("--device") == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): a worker per core on the CPU, at most 8 (the interpreter is bound by
    the CPU); on a GPU one process, as kernels compiling and large tensors in many processes would crowd it."""
    if config.getoption("--device") == "cuda":
        return 0
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _interpret_kept():
    """A test that changes TRITON_INTERPRET fails, and the variable is set back: on a GPU, test_cli's in-process
    `bench --device cpu` left it "1", and every kernel module imported after it in that process was an
    interpreted one (9 failures in tests/test_lce_precision.py, test_portability.py and test_structure.py)."""
    before = os.environ.get("TRITON_INTERPRET")
    yield
    after = os.environ.get("TRITON_INTERPRET")
    if after != before:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
        pytest.fail(f"the test changed TRITON_INTERPRET from {before!r} to {after!r} (use monkeypatch)")


def pytest_runtest_teardown(item):
    """On a GPU, each test's cached blocks go back to the driver: dev/gpu_checks.sh runs 17 pytest processes
    on one card, and a process keeping what its largest test reserved (45.75 GiB seen on an H100) starved
    the others (CUDA out of memory, CUBLAS_STATUS_ALLOC_FAILED in tests that need a few MiB)."""
    if item.config.getoption("--device") == "cuda":
        import torch

        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()


def _p(item, name, default=None):
    spec = getattr(item, "callspec", None)
    return spec.params.get(name, default) if spec else default


def _not_fp32(item):
    return str(_p(item, "dtype", "float32")).removeprefix("torch.") != "float32"


# the fp32 rows of several chunks that the online path keeps in the default run, as (path, N, log), beside
# N = 7 on online and split (forward: 2 chunks of 4); the other N run with --full
FWD_ROWS = {("online", 513, False)}
BWD_ROWS = {("online", 513, False), ("online", 1000, True)}


def _kept_row(item, rows):
    return _p(item, "n") == 7 or (_p(item, "path"), _p(item, "n"), _p(item, "log")) in rows


# test file, or file::test: which of its cases run only with --full (measured: pytest --durations on CI's CPU)
FULL_ONLY = {
    "test_snapshot.py": lambda item: True,  # compiles every kernel variant (~150 s)
    "test_hf.py": lambda item: True,  # transformers' import (~4 s a worker) and tiny models trained (~80 s)
    "test_hf_attention.py": lambda item: True,
    "test_hf_training.py": lambda item: True,
    "test_properties.py::test_gradients_match_oracle": lambda item: True,
    "test_properties.py::test_matches_oracle": lambda item: _p(item, "backend") == "triton",
    "test_masked.py::test_every_mask_pattern": lambda item: (
        _p(item, "path") != "rowblock"
        and (
            _p(item, "log")
            or _p(item, "combo") in ("mask-more", "negative-scale", "causal", "scale-causal")  # (each on rowblock)
        )
    ),
    "test_masked.py::test_backward_paths_fused": lambda item: (
        _p(item, "path") != "rowblock" and (_p(item, "log") or _p(item, "path") == "split" or _p(item, "half"))
    ),
    "test_masked.py::test_gradcheck_float64": lambda item: True,
    # (test_tp*.py's 2-process cases keep gloo, softmax, uneven and empty shards, and disagreeing ranks)
    "test_distributed.py::test_vocabulary_parallel_gloo": lambda item: True,
    "test_tp.py::test_linear_cross_entropy_sliced_backward": lambda item: "3-empty" in item.name,  # (~8 s)
    "test_distributed.py::test_disagreeing_ranks_all_raise_the_same_error": lambda item: True,
    "test_distributed.py::test_slice_widths_change_between_calls": lambda item: True,
    "test_forward.py::test_paths_random_and_special": lambda item: (
        _p(item, "path") != "rowblock" and (_not_fp32(item) or not _kept_row(item, FWD_ROWS))
    ),
    "test_backward.py::test_paths_against_oracle": lambda item: (
        _p(item, "path") != "rowblock" and (_not_fp32(item) or not _kept_row(item, BWD_ROWS))
    ),
    "test_backward.py::test_layouts": lambda item: (
        _p(item, "path") == "split" or (_p(item, "path") == "online" and _p(item, "make") is not None)
    ),  # (the sliced rows on rowblock)
    "test_portability.py::test_cuda_kernels_compile_for_each_part": lambda item: (
        "A100" not in item.name
    ),  # (clusters compile in test_cuda_build.py's staged cases)
    "test_compose.py::test_opcheck_layouts": lambda item: _p(item, "name") not in ("contiguous", "permuted"),
    # V = 5003 (several chunks of the loss kernels) on Triton in bf16; fp16 and fp32 at V = 7 and 513
    "test_cross_entropy.py::test_matches_torch": lambda item: (
        "5003-triton" in item.name and "bfloat16" not in item.name
    ),
    "test_ce_options.py::test_options_match_reference": lambda item: (
        "5003-triton" in item.name and "bfloat16" not in item.name
    ),
    "test_lce.py::test_designs_with_several_chunks": lambda item: "float32-triton" in item.name,  # bf16 kept
    "test_forward.py::test_non_contiguous": lambda item: (
        _p(item, "path") == "split" and (_not_fp32(item) or _p(item, "name") in ("sliced_cols", "expanded_3d"))
    ),
    "test_bench.py::test_cpu_masked_smoke_run": lambda item: True,
    "test_tp.py::test_cross_entropy_every_option": lambda item: "3-" in item.name,
    "test_tp.py::test_linear_cross_entropy_every_option": lambda item: True,
    # (the kernels in the interpreter: test_distributed.py's one-rank branch test keeps them)
    "test_tp_triton.py::test_triton_kernels_in_the_interpreter": lambda item: True,
    "test_tp_dtensor.py::test_dtensor_inputs": lambda item: _p(item, "world") == 3,
    "test_distributed.py::test_slice_work_branch_is_the_one_asked_for": lambda item: _p(item, "backend") == "auto",
    "test_api.py::test_heuristics_table_branches": lambda item: _p(item, "flags", {}).get("splits") == 65,
    "test_bench.py::test_cpu_smoke_run": lambda item: True,  # (test_cpu_ce_smoke_run runs the same entry)
    "test_cuda_build.py::test_two_processes_compile_at_once": lambda item: True,
    # (a process importing torch, ~5 s; compiled autograd over fp32 stays in the default run: the regression)
    "test_cpu_loss.py::test_cpu_path_runs_without_triton": lambda item: True,
    "test_cpu_path.py::test_compiled_autograd_over_eager_calls": lambda item: _p(item, "case") != "float32",
    # NVRTC compiles: one case of each variant and three staged ones by default
    "test_cuda_build.py::test_variant_compiles_with_its_facts": lambda item: (
        (_p(item, "variant"), _p(item, "n"), _p(item, "rows")) in CUDA_MORE
    ),
    "test_cuda_build.py::test_staged_compiles_with_its_facts": lambda item: (
        _p(item, "n") in (50257, 37984) or (_p(item, "n"), _p(item, "rows")) == (131072, 64)
    ),
    "test_cuda_build.py::test_sm80_variants_compile": lambda item: _p(item, "backward"),
    "test_lce.py::test_matches_reference": lambda item: "1031-triton" in item.name and "bfloat16" not in item.name,
    "test_lce.py::test_options_low_precision_designs": lambda item: str(_p(item, "dtype")) == "torch.float16",
    "test_lce.py::test_options": lambda item: _p(item, "backend") == "triton" and _p(item, "name") != "all",
}
CUDA_MORE = {("warp", 1024, 4096), ("block", 16384, 4096), ("cluster", 262144, 8), ("cluster", 65536, 64)}
CUDA_MORE |= {("online", 1 << 21, 512)}


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full") or config.getoption("--device") == "cuda":
        return
    only = config.getoption("--only-full")
    keep, drop = [], []
    for item in items:
        path = item.nodeid.split("::")[0].removeprefix("tests/")
        rule = FULL_ONLY.get(f"{path}::{item.originalname}") or FULL_ONLY.get(path)
        longest = rule is not None and rule(item)
        (keep if longest == only else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def device(request):
    dev = request.config.getoption("--device")
    if dev == "cuda":
        import torch

        if not torch.cuda.is_available():
            pytest.fail("--device cuda given but torch sees no CUDA device")
    return dev


def pytest_terminal_summary(terminalreporter):
    from helpers import WORST

    if WORST:
        worst = ", ".join(f"{k} {v:.3f}" for k, v in sorted(WORST.items()))
        terminalreporter.write_line(f"worst error as a fraction of the tolerance, per output dtype: {worst}")


@pytest.fixture
def one_rank(tmp_path):
    """A gloo group of this process alone (world size 1): the distributed functions run in-process."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
