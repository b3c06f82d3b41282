"""The `fastsoftmax` command's bad arguments: argparse's error (usage, a line naming the argument, exit status
2) before any work, never a Python traceback: shape lists parsed past argparse, row lengths and counts. And
the streams the bench functions print to."""

import os
import subprocess
import sys

import pytest

from fastsoftmax import cli

CASES = [
    (["bench", "--device", "cpu", "--shapes", "bogus"], "argument --shapes: 'bogus' is not MxN"),
    (["bench", "--device", "cpu", "--shapes", "4x0"], "argument --shapes: '4x0' is not MxN"),
    (["bench", "--device", "cpu", "--ce", "--shapes", "8x8x8"], "argument --shapes: '8x8x8' is not MxN"),
    (["bench", "--device", "cpu", "--lce", "--shapes", "4x64"], "argument --shapes: '4x64' is not NxdxV"),
    (["bench", "--device", "cpu", "--masked", "--shapes", "4x4"], "--masked takes its scores' shape from"),
    (["bench", "--device", "cpu", "--masked", "--attention", "2,2"], "argument --attention: '2,2' is not B,H,S"),
    (["bench", "--device", "cpu", "--tune", "x.json", "--shapes", "8"], "argument --shapes: '8' is not MxN"),
    (["asm", "--n", "0"], "argument --n: must be >= 1, got 0"),
    (["asm", "--n", "-5"], "argument --n: must be >= 1, got -5"),
    (["asm", "--rows", "x"], "argument --rows: invalid"),
    # (these ran, or raised a traceback: a --passes typo was timed as the backward and saved under the typo)
    (["bench", "--device", "cpu", "--passes", "fwd,fw"], "argument --passes: unknown ['fw']; valid: fwd, bwd"),
    (["bench", "--device", "cpu", "--masked", "--passes", "zz"], "argument --passes: unknown ['zz']"),
    (["bench", "--device", "cpu", "--dtypes", "float33"], "argument --dtypes: unknown ['float33']"),
    (["bench", "--device", "cpu", "--jobs", "-3"], "argument --jobs: must be >= 0, got -3"),
    (["bench", "--device", "cpu", "--lce", "--lce-memory", "-5"], "argument --lce-memory: must be >= 1, got -5"),
    (["bench", "--device", "cpu", "--lce", "--lce-spread", "nan"], "argument --lce-spread: must be a finite number"),
    (["bench", "--device", "cpu", "--lce", "--lce-spread", "-1"], "argument --lce-spread: must be a finite number"),
    (["asm", "--arch", "sm90"], "argument --arch: expected sm_<compute capability>[a]"),
    (["asm", "--arch", "sm_"], "argument --arch: expected sm_<compute capability>[a]"),
]


@pytest.mark.parametrize("argv, message", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    """Each exits with status 2 and the message (they raised ValueError or ZeroDivisionError tracebacks, and
    asm --n -5 printed code for a negative row length). main sets TRITON_INTERPRET for --device cpu before
    it finds the error: set back here (conftest's _interpret_kept; monkeypatch records no variable unset)."""
    interpret = os.environ.get("TRITON_INTERPRET")
    try:
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
    finally:
        if interpret is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = interpret
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_default_streams_are_the_ones_at_call_time():
    """The bench functions' default out and progress are sys.stdout and sys.stderr as they are when a
    function writes, not when its module was imported: a program that imports them under a redirection it
    then closes (pytest's capture did, this file's tests before test_bench.py's) prints where it prints now."""
    code = """
import contextlib, io, json, sys
buf = io.StringIO()
with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
    from fastsoftmax.bench import lce, report, suite, tuning
buf.close()
load = lambda name: json.load(open(f"{sys.argv[1]}/bench/results/{name}.json"))
report.print_tables(load("h200"))
report.print_masked(load("h200_masked"))
report.print_ce(load("h200_ce"))
lce.print_lce(load("h200_lce"))
print("still here")
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code, root], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "still here" in r.stdout, r.stderr[-2000:]


@pytest.mark.parametrize("mode", ["--ce", "--masked", "--lce", None])
def test_unknown_implementations_are_refused_in_every_mode(mode, capsys):
    """bench --ce --impls bogus timed nothing and exited 0; --masked raised KeyError: exit 2 before any work."""
    interpret = os.environ.get("TRITON_INTERPRET")
    try:
        code = cli.main(["bench", "--device", "cpu", *([mode] if mode else []), "--impls", "fastsoftmax,bogus"])
    finally:
        if interpret is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = interpret
    err = capsys.readouterr().err
    assert code == 2 and "unknown implementations ['bogus']; valid: " in err, (code, err)


def test_help_names_no_file_that_is_not_there():
    """bench --help named bench/suite.py, which is src/fastsoftmax/bench/suite.py."""
    out = subprocess.run([sys.executable, "-m", "fastsoftmax", "bench", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "fastsoftmax.bench.suite's SUITE" in out.stdout, out.stdout
    assert "bench/suite.py" not in out.stdout
