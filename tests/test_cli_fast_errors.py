"""Config and data errors answer before torch is imported (importing it takes seconds, 2.6-23 s on a busy machine):
each command line runs in a fresh interpreter, and a small harness reports whether ``torch`` was in
``sys.modules`` when the command returned. No timing is asserted; the import is what costs the time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
# Runs the CLI and prints, on the last line of stdout, the exit status and whether torch was imported.
HARNESS = """
import json, sys
from moetrain.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:  # argparse's own errors
    code = e.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules}))
"""


def _run(tmp_path: Path, *argv: str) -> tuple[dict, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", HARNESS, *argv], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr.strip()


@pytest.mark.parametrize("argv, words", [
    (["train", "model.moe.num_expert=8"], "model.moe.num_expert: unknown config key; did you mean "
                                          "'model.moe.num_experts'?"),
    (["train", "--data", "missing.txt"], "data path 'missing.txt' does not exist"),
    (["train", "--preset", "tiny", "--data", "nothing/*.txt"], "the glob matches no files"),
    (["train", "--preset", "tiny", "train.lr=fast"], "train.lr"),
    (["train", "--config", "missing.toml"], "missing.toml"),
    (["train", "--dry-run", "model.hidden=0"], "model.hidden"),
    (["train", "--list-fields", "model.moe.num_expert=8"], "model.moe.num_expert"),
    (["train", "--steps", "abc"], None),
    (["train", "--steps", "2", "train.steps=1.5"], "train.steps: expected an integer, got 1.5"),
    (["train", "--data", "corpus", "data.path=[1]"], "data.path: expected a string, got [1]"),
    (["compare", "--out", "cmp", "moe:", "dense:model.moe.num_expert=8"], "model.moe.num_expert"),
    (["compare", "--out", "cmp", "--data", "missing.txt", "moe:", "dense:model.moe_every=0"],
     "data path 'missing.txt' does not exist"),
])
def test_config_and_data_errors_answer_before_torch(tmp_path, argv, words):
    result, err = _run(tmp_path, *argv)
    assert result["code"] == 2, (result, err)
    assert err.count("\n") == 0 and "error:" in err, err
    if words:
        assert words in err, err
    assert not result["torch"], f"{argv}: torch was imported before the error"
    assert not (tmp_path / "cmp").exists() and not (tmp_path / "runs").exists()


def test_a_config_file_value_an_override_replaces_is_still_checked(tmp_path):
    (tmp_path / "run.toml").write_text("[train]\nsteps = 1.5\n")
    result, err = _run(tmp_path, "train", "--config", "run.toml", "train.steps=2")
    assert result["code"] == 2 and "train.steps: expected an integer, got 1.5" in err, err
    assert not result["torch"]


def test_the_harness_sees_torch_when_a_command_imports_it(tmp_path):
    """The control: ``train --dry-run`` builds the model on the meta device, so it imports torch."""
    result, err = _run(tmp_path, "train", "--dry-run", "--preset", "tiny")
    assert result == {"code": 0, "torch": True}, err
