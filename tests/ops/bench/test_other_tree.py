"""`other_tree`: a script run with another checkout first on the path, trees taking turns."""

from __future__ import annotations

from pathlib import Path

from ops.bench.other_tree import REPO, alternate, run_on_tree, script_in

SCRIPT = '''import json, os, sys
print("noise")
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "path": os.environ["PYTHONPATH"].split(os.pathsep)}))
'''


def test_trees_take_turns_with_the_extra_flags_on_the_last_round_only(tmp_path: Path, monkeypatch):
    script, trees = tmp_path / "script.py", {"after": tmp_path / "a", "before": tmp_path / "b"}
    script.write_text(SCRIPT)
    for tree in trees.values():
        tree.mkdir()
    monkeypatch.setenv("PYTHONPATH", "/site-packages-beside")
    runs = alternate(script, trees, ["--x=1"], rounds=2, last_round_extra=["--profile"])
    assert list(runs) == ["after", "before"]
    for name, results in runs.items():
        assert [r["argv"] for r in results] == [["--x=1", "--print-json"], ["--x=1", "--profile", "--print-json"]]
        assert all(Path(r["cwd"]) == trees[name] and r["path"] == [str(trees[name]), "/site-packages-beside"] for r in results)


def test_without_a_pythonpath_only_the_tree_is_on_it(tmp_path: Path, monkeypatch):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert run_on_tree(script, tmp_path, [])["path"] == [str(tmp_path)]


def test_a_tree_runs_its_own_copy_of_a_script_where_it_has_one(tmp_path):
    """Each tree's benchmark builds its core with its own harness: the trees' scheduler APIs may differ."""
    ours = REPO / "ops/bench/host_step_cost.py"
    (tmp_path / "ops/bench").mkdir(parents=True)
    assert script_in(tmp_path, ours) == ours  # a tree from before the script: this checkout's copy
    (tmp_path / "ops/bench/host_step_cost.py").write_text(SCRIPT)
    assert script_in(tmp_path, ours) == tmp_path / "ops/bench/host_step_cost.py"
    assert run_on_tree(ours, tmp_path, ["--x"])["argv"] == ["--x"]  # it ran their copy (ours would not print argv)
    assert script_in(tmp_path, tmp_path / "elsewhere.py") == tmp_path / "elsewhere.py"  # not ours: as given
