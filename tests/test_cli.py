"""`xlaserve generate`, the smallest real use of the stack, as a user runs it."""

from __future__ import annotations

import subprocess
import sys


def test_generate_answers_capital_of_france(model_dir) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "xlaserve.cli", "generate", "--model", str(model_dir),
         "--chat", "What is the capital of France?", "--max-tokens", "32"],
        capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_generate_missing_model_is_one_line(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "xlaserve.cli", "generate", "--model",
                        str(tmp_path / "none"), "--prompt", "hi"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "not a model folder" in r.stderr and r.stderr.strip().count("\n") == 0
