"""scripts/check-layering.py: the coordinator's parts include only the parts below them, and the
what-if planner only the engine (DESIGN 2)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "check-layering.py"


def run(root):
    return subprocess.run([sys.executable, str(CHECK), str(root)], capture_output=True, text=True, timeout=60)


def test_the_repository_keeps_its_layers():
    r = run(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_an_include_of_a_part_above_and_the_planner_reaching_into_the_core_are_named(tmp_path):
    engine = tmp_path / "coordinator" / "engine"
    engine.mkdir(parents=True)
    (engine / "rule.cc").write_text('#include "coordinator/settings/options.h"\n'
                                    '#include "coordinator/core/shard_group.h"\n')
    client = tmp_path / "client"
    client.mkdir()
    (client / "plan.cc").write_text('#include "coordinator/engine/decision_engine.h"\n\n'
                                    '#include "coordinator/core/coordinator_core.h"\n')
    r = run(tmp_path)
    assert r.returncode == 1, r.stdout
    lines = r.stdout.splitlines()
    assert any(l.startswith("coordinator/engine/rule.cc:2: coordinator/engine includes coordinator/core") for l in lines), lines
    assert any(l.startswith("client/plan.cc:3: the planner includes coordinator/core") for l in lines), lines
    assert not any("settings/options.h" in l or "decision_engine" in l for l in lines), lines
