"""Tests run on the CPU by default, the Triton kernels in Triton's interpreter; `pytest --device cuda` runs
the same tests on a GPU with compiled kernels. TRITON_INTERPRET must be set before fastsoftmax first
imports its kernels, so it is set here, before any test module runs."""

import os

import pytest


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", choices=["cpu", "cuda"], help="device the tests run on")


def pytest_configure(config):
    if config.getoption("--device") == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)


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
