"""`make serve` installs the package and its runtime dependencies only; `make test` adds the
test extra (torch, transformers, openai): checked on the commands make would run."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def planned(target: str) -> str:
    """The commands `make TARGET` would run from scratch (-B: as if nothing were built)."""
    return subprocess.run(["make", "-n", "-B", target], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout


def test_serve_installs_the_runtime_only() -> None:
    serve = planned("serve")
    assert re.search(r"pip install -e \.$", serve, re.M), serve
    assert "[test]" not in serve and "torch" not in serve
    assert "xlaserve.kernels.cpu.build" in serve and "xlaserve serve" in serve


def test_test_adds_the_test_extra() -> None:
    test = planned("test")
    assert "pip install -e '.[test]'" in test and "tests/run_all.py" in test


def test_runtime_dependencies_need_no_torch() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [re.split(r"[<>=\[; ]", d, maxsplit=1)[0].lower() for d in project["dependencies"]]
    assert not {"torch", "transformers", "openai", "accelerate"} & set(names), names
    assert "torch==2.13.0" in project["optional-dependencies"]["test"]


def test_test_installs_the_browser_when_missing() -> None:
    test = planned("test")
    assert "command -v chromium" in test and "apt-get install" in test
    assert "chromium-driver" in test
