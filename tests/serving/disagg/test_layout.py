"""The split's workers are single-process (serving/disagg/workers.py): `xlaserve serve` with a
split model and `xlaserve worker --role prefill|decode` refuse a multi-process layout
([distributed] or XLASERVE_NUM_PROCESSES) by name, at start-up, before any engine loads (the
configs' engine factory does not exist: an error about it would show it was being built)."""

from __future__ import annotations

from pathlib import Path

import pytest

from xlaserve.serving.grpc.auth import DEFAULT_TOKEN_ENV
from xlaserve.serving.grpc.worker import worker_main
from xlaserve.serving.http.server import serve_main

SPLIT = """
[[models]]
name = "m"
engine = "no_such_module:build"
replicas = ["prefill://127.0.0.1:50071", "decode://127.0.0.1:50072"]
"""
TABLE = '[distributed]\ncoordinator = "127.0.0.1:50070"\nnum_processes = 2\nprocess_id = 0\n'
ENV = {"XLASERVE_COORDINATOR": "127.0.0.1:50070", "XLASERVE_NUM_PROCESSES": "2",
       "XLASERVE_PROCESS_ID": "0"}


@pytest.fixture
def clean_env(monkeypatch):
    for k in (DEFAULT_TOKEN_ENV, *ENV, "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
              "JAX_PROCESS_ID"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


@pytest.mark.parametrize("by", ["table", "env"])
def test_split_on_a_multiprocess_layout_is_refused_by_name(tmp_path: Path, clean_env, capsys,
                                                            by):
    cfg = tmp_path / "split.toml"
    cfg.write_text((TABLE if by == "table" else "") + SPLIT)
    if by == "env":
        for k, v in ENV.items():
            clean_env.setenv(k, v)
    assert serve_main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "num_processes=2, but models ['m@1'] are split into prefill:// and decode://" \
        in err, err
    for role in ("prefill", "decode"):
        assert worker_main(["--config", str(cfg), "--model", "m", "--role", role]) == 2
        err = capsys.readouterr().err
        assert f"--role {role}: [distributed]" in err and "num_processes=2" in err, err
        assert "no_such_module" not in err, err


def test_a_single_process_layout_still_reaches_the_engine(tmp_path: Path, clean_env, capsys):
    cfg = tmp_path / "one.toml"
    cfg.write_text(TABLE.replace("num_processes = 2", "num_processes = 1") + SPLIT)
    assert worker_main(["--config", str(cfg), "--model", "m", "--role", "decode"]) == 2
    assert "no_such_module" in capsys.readouterr().err
