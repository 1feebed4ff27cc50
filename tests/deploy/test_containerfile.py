"""deploy/Containerfile read as a builder reads it (line continuations joined, stages split at
FROM): every COPY source from the build context exists in the repository and is not excluded
by .dockerignore, every `--from` names an earlier stage, the two targets run as a non-root user
with the `xlaserve` console script (pyproject's xlaserve.cli:main) as entry point and a
default command the CLI accepts.  Building the image is documented (README "Deploying"), not
run here."""

from __future__ import annotations

import fnmatch
import json
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = ROOT / "deploy" / "Containerfile"
TARGETS = ("cpu", "cuda")


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (KEYWORD, arguments)

    def last(self, keyword: str) -> str | None:
        found = [args for kw, args in self.instructions if kw == keyword]
        return found[-1] if found else None


def parse(text: str) -> list[Stage]:
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        if raw.lstrip().startswith("#") or not raw.strip():
            continue
        pending += raw.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        lines.append(pending.strip())
        pending = ""
    assert not pending, f"{CONTAINERFILE}: a continuation line never ends: {pending!r}"
    stages: list[Stage] = []
    for line in lines:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            words = args.split()
            assert len(words) == 3 and words[1].upper() == "AS", f"unnamed stage: {line!r}"
            stages.append(Stage(words[2], words[0]))
        elif keyword != "ARG" or stages:
            stages[-1].instructions.append((keyword, args.strip()))
    return stages


STAGES = parse(CONTAINERFILE.read_text())
BY_NAME = {s.name: s for s in STAGES}


def ignored(path: str) -> bool:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    parts = Path(path).parts
    return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(parts[0], p) for p in patterns)


def copies() -> list[tuple[str, list[str], str | None]]:
    """(stage, sources, --from stage or None) of every COPY."""
    out = []
    for stage in STAGES:
        for kw, args in stage.instructions:
            if kw == "COPY":
                words = shlex.split(args)
                flags = [w for w in words if w.startswith("--")]
                paths = [w for w in words if not w.startswith("--")]
                src_stage = next((f.split("=", 1)[1] for f in flags if f.startswith("--from=")),
                                 None)
                out.append((stage.name, paths[:-1], src_stage))
    return out


def test_the_two_targets_and_their_bases() -> None:
    assert set(TARGETS) <= set(BY_NAME), sorted(BY_NAME)
    cuda_build = BY_NAME["build-cuda"]
    assert any(kw == "RUN" and "jax[cuda12]" in a for kw, a in cuda_build.instructions)
    assert any(kw == "RUN" and "xlaserve.kernels.cpu.build" in a
               for kw, a in BY_NAME["cpu"].instructions), "the CPU image builds the kernels"


def test_every_copy_source_exists_in_the_context() -> None:
    names = [s.name for s in STAGES]
    seen = 0
    for stage, sources, src_stage in copies():
        if src_stage is not None:
            assert src_stage in names[:names.index(stage)], \
                f"COPY --from={src_stage} in stage {stage}: no earlier stage of that name"
            continue
        for src in sources:
            seen += 1
            assert (ROOT / src).exists(), f"stage {stage}: COPY source {src!r} is not in the repo"
            assert not ignored(src), f"stage {stage}: COPY {src!r} is excluded by .dockerignore"
    assert seen >= 4


@pytest.mark.parametrize("target", TARGETS)
def test_target_runs_the_cli_as_non_root(target: str) -> None:
    stage = BY_NAME[target]
    user = stage.last("USER")
    assert user is not None and user.split(":")[0] not in ("0", "root"), f"{target}: USER {user}"
    assert json.loads(stage.last("ENTRYPOINT") or "null") == ["xlaserve"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["xlaserve"] == "xlaserve.cli:main"
    cmd = json.loads(stage.last("CMD") or "null")
    assert cmd[:1] == ["serve"] and "--config" in cmd, cmd


def test_fetch_model_script_is_executable_sh() -> None:
    script = ROOT / "deploy" / "image" / "fetch-model.sh"
    assert script.read_text().startswith("#!/bin/sh\n")
    assert script.stat().st_mode & 0o111, f"{script} is not executable"
