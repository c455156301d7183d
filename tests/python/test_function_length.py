"""scripts/check-function-length.py: the house limit of 60 lines per product function (issue 27)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "check-function-length.py"


def run(root):
    return subprocess.run([sys.executable, str(CHECK), str(root)], capture_output=True, text=True, timeout=120)


def test_the_repository_has_no_product_function_over_60_lines():
    r = run(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def cpp_function(name, body_lines):
    body = "\n".join(f"  x += {i};  // {{ a brace in a comment" for i in range(body_lines))
    return f'int {name}(int x) {{\n  const char* s = "}} in a string";\n{body}\n  return x;\n}}\n'


def test_a_long_function_is_named_with_its_file_line_and_length(tmp_path):
    src = tmp_path / "coordinator" / "core"
    src.mkdir(parents=True)
    # 57 + 4 = 61 lines: one over. A class and a namespace around it do not count as functions.
    (src / "long.cc").write_text("namespace n {\nstruct S {\n  int Short() { return 1; }\n};\n"
                                 + cpp_function("TooLong", 57) + cpp_function("JustFits", 56) + "}  // namespace n\n")
    py = tmp_path / "python" / "shardcoord"
    py.mkdir(parents=True)
    (py / "m.py").write_text("def too_long():\n" + "    x = 1\n" * 60 + "\n\ndef fits():\n" + "    x = 1\n" * 59)
    r = run(tmp_path)
    assert r.returncode == 1, r.stdout
    lines = r.stdout.splitlines()
    assert any(l.startswith(os.path.join("coordinator", "core", "long.cc") + ":5: TooLong is 61 lines") for l in lines), lines
    assert any(l.startswith(os.path.join("python", "shardcoord", "m.py") + ":1: too_long is 61 lines") for l in lines), lines
    assert not any("JustFits" in l or "fits is" in l or "Short" in l for l in lines), lines
