"""The `fastsoftmax` command's bad arguments: argparse's error (usage, a line naming the argument, exit status
2) before any work, never a Python traceback: shape lists parsed past argparse, row lengths and counts."""

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
]


@pytest.mark.parametrize("argv, message", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    """Each exits with status 2 and the message (they raised ValueError or ZeroDivisionError tracebacks, and
    asm --n -5 printed code for a negative row length)."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
