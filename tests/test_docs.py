"""docs/architecture.md stays checkable against the code: every file it names exists, and every
identifier it quotes (`LLMEngine.step`, `lay_out`, `max_num_seqs`, ...) occurs in the package's
sources, so a rename that leaves the page behind fails here; and its hops of one chat request are
at most 15, each a function that exists."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*(?:\(\))?")
SOURCES = [p for d in ("xlaserve", "configs", "deploy", "tests")
           for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".toml", ".json", ".proto",
                                                          ".cc", ".h", ".html", ".sh")]


def quoted() -> list[str]:
    return re.findall(r"`([^`\n]+)`", DOC.read_text())


def test_every_named_file_exists() -> None:
    files = {str(p.relative_to(ROOT)) for p in SOURCES} | {
        str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_dir() and ".git" not in p.parts}
    named = [q for q in quoted() if re.fullmatch(r"[\w./-]+(\.(py|toml|md|proto|cc|h|html)|/)",
                                                  q) and "://" not in q
             and not q.startswith("shared/")]   # the workspace's notes, outside the repo
    assert len(named) > 50
    missing = [q for q in named
               if not any(f == q.rstrip("/") or f.endswith("/" + q.rstrip("/")) for f in files)]
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_every_quoted_identifier_occurs_in_the_code() -> None:
    text = "\n".join(p.read_text(errors="replace") for p in SOURCES)
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))
    # names, not plain words: snake_case, CamelCase or dotted (`LLMEngine.step`)
    idents = [q for q in quoted() if IDENT.fullmatch(q)
              and ("_" in q or "." in q or any(c.isupper() for c in q[1:]))]
    assert len(idents) > 100
    missing = sorted({q for q in idents
                      if not all(part in words for part in q.rstrip("()").split("."))})
    assert not missing, f"docs/architecture.md quotes names the code does not have: {missing}"


def test_the_hops_are_real_functions() -> None:
    section = DOC.read_text().split("### One chat request in 15 hops")[1].split("###")[0]
    hops = re.findall(r"^\d+\. `([\w.]+):([\w.]+)`", section, flags=re.M)
    assert 10 <= len(hops) <= 15, hops
    for module, qualname in hops:
        target = importlib.import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part)
        assert callable(target), f"{module}:{qualname} is not a function"
