"""Towers laid out as Hugging Face builds them (tests/python/hf_lookalikes.py), sharded per layer:
the manifest finds each tower's layers and its rest unit with no layer_lists, and two Gloo ranks
run every decision bitwise equal to the unsharded model, gathering in the same order
(hf_family_ranks.py does the work in each rank process)."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hf_lookalikes as hfl  # noqa: E402


@pytest.mark.parametrize("families", [["llava", "llava_next", "llava_onevision", "gemma3"],
                                      ["qwen2_vl", "qwen2_5_vl", "internvl", "qwen2_audio"],
                                      ["idefics3", "smolvlm", "mllama"]])
def test_two_ranks_shard_each_family_per_layer_bitwise(tmp_path, families):
    init = f"file://{tmp_path}/store"
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "hf_family_ranks.py"), init, str(r), "2", *families],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outputs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a rank did not finish within 150 s (a collective mismatch hangs): {families}")
        assert p.returncode == 0, f"rank failed:\n{err[-3000:]}"
        outputs.append(out)
    for name in families:
        assert all(f"ok {name}:" in out for out in outputs), outputs
    print("".join(outputs[0]))


def test_every_family_is_covered():
    assert set(hfl.FAMILIES) == {"llava", "llava_next", "llava_onevision", "gemma3", "qwen2_vl", "qwen2_5_vl",
                                 "internvl", "qwen2_audio", "idefics3", "smolvlm", "mllama"}
