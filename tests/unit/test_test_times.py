"""tools/test_times.py: a junit report and the conftest's compile records become one row per test file, with the
files over the budget named."""

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("test_times", os.path.join(ROOT, "tools", "test_times.py"))
test_times = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(test_times)

JUNIT = """<testsuites><testsuite>
<testcase classname="tests.unit.test_a" name="test_one" time="50.0"/>
<testcase classname="tests.unit.test_a" name="test_two" time="20.0"/>
<testcase classname="tests.parity.test_b.TestGroup" name="test_three" time="5.0"/>
</testsuite></testsuites>"""


def test_rows_per_file_with_compile_seconds_and_the_files_over_budget(tmp_path, capsys):
    (tmp_path / "default.xml").write_text(JUNIT)
    (tmp_path / "times").mkdir()
    records = {"tests/unit/test_a.py::test_one": {"compile": 30.0, "wall": 50.0}}
    (tmp_path / "times" / "gw0.json").write_text(json.dumps(records))
    rows = test_times.load([str(tmp_path / "default.xml")], str(tmp_path / "times"))
    assert rows == {
        "tests/unit/test_a.py": {"tests": 2, "wall": 70.0, "compile": 30.0},
        "tests/parity/test_b.py": {"tests": 1, "wall": 5.0, "compile": 0.0},
    }
    assert test_times.main([str(tmp_path / "default.xml"), "--times", str(tmp_path / "times")]) == 0
    out = capsys.readouterr().out.splitlines()
    a = next(line for line in out if line.startswith("tests/unit/test_a.py"))
    assert a.split()[1:] == ["2", "70.0", "30.0", "40.0", "OVER"]
    assert out[-1] == "1 file(s) over the 60 s budget: tests/unit/test_a.py"
    assert out[-2].endswith(" 3     75.0, 40% compiling in-process")
