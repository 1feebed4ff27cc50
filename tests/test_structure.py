"""The size bounds docs/architecture.md's package map relies on, so that a reader can hold any
file in mind: no module over 400 lines and no function over 80 in `xlaserve/serving`,
`models`, `sharding`, `kernels`, `checkpoints` and `bench` (protoc's generated gRPC stubs
excepted)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "xlaserve"
PACKAGES = ("serving", "models", "sharding", "kernels", "checkpoints", "bench")
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 80
# Known offenders, each failing the bound today (strict: one that passes must leave the list).
# checkpoints/ is being edited on another branch, which is to split it.
KNOWN = {"checkpoints/gguf_file.py": "read_gguf is 112 lines, not yet split"}


def modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
                  if not p.name.endswith(("_pb2.py", "_pb2_grpc.py")))


def test_there_are_modules_to_check() -> None:
    names = {str(p.relative_to(ROOT)) for p in modules()}
    assert len(names) > 150
    assert {"kernels/bench/gpu_check.py", "checkpoints/gguf_file.py", "bench/cli.py"} <= names


def params() -> list[object]:
    return [pytest.param(p, id=str(p.relative_to(ROOT)), marks=[pytest.mark.xfail(
        strict=True, reason=KNOWN[str(p.relative_to(ROOT))])]
        if str(p.relative_to(ROOT)) in KNOWN else []) for p in modules()]


@pytest.mark.parametrize("path", params())
def test_module_and_functions_within_bounds(path: Path) -> None:
    text = path.read_text()
    lines = len(text.splitlines())
    assert lines <= MAX_FILE_LINES, f"{path.relative_to(ROOT)}: {lines} lines"
    long = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(text))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{path.relative_to(ROOT)}: functions over {MAX_FUNCTION_LINES} lines {long}"
