"""The docs are data (STYLE.md, "Docs from data"): every generated region of the files docs.DOCS names (README.md,
docs/*.md, bench/results/README.md) is what fastsoftmax.bench.docs renders from the committed result files, every
```python block of the README runs as written on the CPU (a block whose first line is `# needs a CUDA GPU` is
compiled only), and the command's help names nothing outside the repository."""

import contextlib
import io
import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from fastsoftmax.bench import docs

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
FILES = [p for pattern in docs.DOCS for p in sorted(ROOT.glob(pattern))]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```python\n(.*?)^```", README, re.S | re.M)
GPU = "# needs a CUDA GPU"


def test_generated_regions_match_the_result_files():
    stale = []
    for path in FILES:
        _, changed = docs.update(path.read_text(), RESULTS, str(path.relative_to(ROOT)))
        stale += changed
    fix = "regions that differ from the result files (`python -m fastsoftmax.bench.docs` rewrites them):\n"
    assert not stale, fix + "\n".join(stale)
    for name in ("README.md", "docs/performance.md", "docs/investigations.md", "bench/results/README.md"):
        assert docs.REGION.search((ROOT / name).read_text()), f"{name} has no generated region"


def test_markers_in_table_cells_keep_the_row_whole(tmp_path):
    """GitHub's tables split a row at every bare `|`, inside an HTML comment too: a marker in a table row
    writes `\\|` (docs.render reads it as `|`), and renders what the same marker with `|` renders."""
    broken = []
    for path in FILES:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith("|"):
                names = re.findall(r"<!-- generated: (.+?) -->", line)
                broken += [f"{path.relative_to(ROOT)}:{n} {m}" for m in names if re.search(r"(?<!\\)\|", m)]
    assert not broken, "markers with a bare | in a table row:\n" + "\n".join(broken)
    results = _results(tmp_path, "f.json", {"records": [{"k": "a", "v": 1.234}, {"k": "b", "v": 2.5}]})
    escaped = docs.render(r"range f.json /records/[k=a\|b]/v \| .2f", results)
    assert escaped == docs.render("range f.json /records/[k=a|b]/v | .2f", results) == "1.23-2.50"


def _results(tmp_path: Path, name: str, doc: dict) -> Path:
    (tmp_path / name).write_text(json.dumps(doc))
    docs.load.cache_clear()
    return tmp_path


def test_a_field_the_file_lacks_is_an_error_naming_file_and_field(tmp_path):
    """cpu_torch.json and h200_host.json are rewritten by later runs: a field they lose must fail the check, not
    leave the old text."""
    rec = {"case": "softmax", "M": 1, "N": 4096, "dtype": "float32", "fastsoftmax_us": 4.0, "torch_us": 5.0}
    results = _results(tmp_path, "cpu_torch.json", {"records": [rec, dict(rec, dtype="bfloat16")]})
    with pytest.raises(docs.DocsError, match=r"cpu_torch\.json.*'ratio'"):
        docs.render("perf_cpu", results)
    host = {"records": [{"call": "softmax 1x4096 fp32", "fastsoftmax_us": 6.04, "torch_us": 7.0}]}
    results = _results(tmp_path, "h200_host.json", host)
    call = "/records/[call=softmax 1x4096 fp32]"
    assert docs.render(f"value h200_host.json {call}/fastsoftmax_us | .1f", results) == "6.0"
    assert docs.render(f"ratio h200_host.json {call}/fastsoftmax_us ; {call}/torch_us | .2f", results) == "0.86"
    with pytest.raises(docs.DocsError, match=r"h200_host\.json.*'torch_graph_us'"):
        docs.render(f"value h200_host.json {call}/torch_graph_us", results)
    with pytest.raises(docs.DocsError, match="no result file"):
        docs.render("value h200_gone.json /x", results)
    with pytest.raises(docs.DocsError, match="does not say"):
        docs.render("quote h200_host.json /records/0/call | 8x4096", results)
    with pytest.raises(docs.DocsError, match="unknown region"):
        docs.render("no_such_table", results)


def test_the_loss_table_has_a_column_for_each_implementation_the_file_ran(tmp_path):
    """perf_lce: a column for an implementation of its list that the file ran (the skip once an H200 run has
    it), none for one it did not (not a column of "fails"); one that ran and failed says so."""

    def rec(impl, ok=True):
        return {"impl": impl, "N": 8, "d": 4, "V": 16, "ms": 2.0, "vs_floor": 2.0, "peak_bytes": 1e9, "ok": ok}

    doc = {"peers": {}, "records": [rec("floor"), rec("cce"), rec("fastsoftmax_mem", ok=False)]}
    table = docs.render("perf_lce", _results(tmp_path, "h200_lce.json", doc))
    assert "CCE" in table and "peak at CCE's" in table and "fails" in table and "skip_eps" not in table, table
    doc["records"].append(rec("fastsoftmax_skip"))
    table = docs.render("perf_lce", _results(tmp_path, "h200_lce.json", doc))
    assert "skip_eps" in table and "torch.compile" not in table, table


def test_update_rewrites_stale_regions_and_check_names_them(tmp_path, capsys):
    host = {"records": [{"call": "softmax 1x4096 fp32", "fastsoftmax_us": 6.04, "torch_us": 7.0}]}
    (tmp_path / "bench" / "results").mkdir(parents=True)
    _results(tmp_path / "bench" / "results", "h200_host.json", host)
    region = "<!-- generated: value h200_host.json /records/0/torch_us | .1f -->{}<!-- /generated -->"
    (tmp_path / "README.md").write_text(f"torch takes {region.format('9.9')} us\n")
    docs.load.cache_clear()
    assert docs.main(["--check", "--root", str(tmp_path)]) == 1
    assert "README.md:1 value h200_host.json" in capsys.readouterr().out
    assert docs.main(["--root", str(tmp_path)]) == 0
    assert (tmp_path / "README.md").read_text() == f"torch takes {region.format('7.0')} us\n"
    assert docs.main(["--check", "--root", str(tmp_path)]) == 0
    docs.load.cache_clear()


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_python_block_runs_on_the_cpu(index, tmp_path):
    """Each block alone, in a fresh interpreter in an empty directory, with the checkout's src/ on the path."""
    code = BLOCKS[index]
    if code.startswith(GPU):
        compile(code, f"README.md python block {index}", "exec")
        return
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, f"README.md python block {index} failed:\n{code}\n{run.stdout}\n{run.stderr}"


def test_readme_has_a_block_that_runs():
    assert any(not b.startswith(GPU) for b in BLOCKS), "the README needs at least one ```python block run on a CPU"


def _help(*cmd: str) -> str:
    """`python -m fastsoftmax [CMD] --help`: runpy runs the package's __main__ as -m does (here, in this
    interpreter, where torch is imported already)."""
    out = io.StringIO()
    with mock.patch.object(sys, "argv", ["fastsoftmax", *cmd, "--help"]), contextlib.redirect_stdout(out):
        with pytest.raises(SystemExit) as stop:
            runpy.run_module("fastsoftmax", run_name="__main__", alter_sys=True)
    assert stop.value.code in (0, None), f"fastsoftmax {' '.join(cmd)} --help exited {stop.value.code}"
    return out.getvalue()


HISTORY = {
    "a path outside the repository": r"(?:^|[\s('\"`=])(?:/|~\w*/|\.\./)[\w.]\S*",
    "a log, an issue or a date": r"dev/logs|\blogs?/|\bissue\b|\b20\d\d-\d\d-\d\d\b",
    "a commit": r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b",
}


def _inside(path: str) -> bool:
    """A relative path the help names exists in the checkout, from its root, src/ or the package (a <name>
    placeholder: its folder)."""
    path = path.split("<")[0]
    bases = (ROOT, ROOT / "src", ROOT / "src" / "fastsoftmax")
    return ".." not in path and any((base / path).exists() for base in bases)


def test_cli_help_names_nothing_outside_the_repository():
    top = _help()
    commands = re.search(r"[{]([\w,-]+)[}]", top)[1].split(",")
    assert len(commands) >= 3, top
    text = "\n".join([top, *(f"=== fastsoftmax {cmd} --help\n{_help(cmd)}" for cmd in commands)])
    bad = [f"{what}: {m.group().strip()!r}" for what, pat in HISTORY.items() for m in re.finditer(pat, text)]
    paths = re.findall(r"[\w.<>-]+(?:/[\w.<>-]+)+\.\w+", text)
    bad += [f"a path not in the repository: {p!r}" for p in paths if not _inside(p)]
    assert not bad, "the command's help:\n" + "\n".join(bad) + "\n\n" + text


def indexed(readme: str) -> set[str]:
    """The result files bench/results/README.md's tables give a row to (named in each row's first cell)."""
    cells = re.findall(r"^\| ([^|]*) \|", readme, re.M)
    return {name for cell in cells for name in re.findall(r"`([^`]+\.json)`", cell)}


def test_every_result_file_has_its_row_and_every_row_its_file():
    """bench/results/README.md indexes every committed result file (what it holds, the command, the date, the
    commit) and names none that is gone: three cited files once had no row."""
    on_disk = {p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*.json")}
    rows = indexed((RESULTS / "README.md").read_text())
    assert on_disk - rows == set(), "result files without a row in bench/results/README.md"
    assert rows - on_disk == set(), "rows in bench/results/README.md naming no file"


def test_the_index_check_sees_a_missing_row():
    readme = "| file | what |\n|---|---|\n| `a.json` | one |\n| `checks/b.json`, `.png`, `c.json` | two, `d.json` |\n"
    assert indexed(readme) == {"a.json", "checks/b.json", "c.json"}
    assert indexed(readme.replace("| `a.json` | one |\n", "")) == {"checks/b.json", "c.json"}
