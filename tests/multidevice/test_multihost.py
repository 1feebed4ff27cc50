"""Two processes, one mesh: process 0 schedules, both run every step; a dead peer is reported.

Each process has two CPU devices and gloo collectives over loopback; the pipeline=2 x tensor=2
mesh spans all four (stage 0 on process 0's devices, stage 1 on process 1's).  The processes
are multihost_worker.py, started here."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

from xlaserve.serving.engine.engine import LLMEngine
from xlaserve.serving.runner.runner import ModelRunner
from xlaserve.serving.tokenizer import Tokenizer
from xlaserve.sharding.mesh import make_mesh

from .engine_workload import MULTIHOST_ENGINE, run_workload, workload
from .scenarios import TINY, tiny_params

ROOT = Path(__file__).resolve().parents[2]
REQUESTS = 4
WALL_LIMIT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(tmp: Path, model_dir: Path, *extra_1: str) -> tuple[list[int], dict, list[str]]:
    """Start both processes; returns (exit codes, process 0's result, both logs)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               XLASERVE_MODEL_DIR=str(model_dir),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    port = free_port()
    out = tmp / "process0.json"
    procs = []
    for pid, extra in ((1, extra_1), (0, ())):
        cmd = [sys.executable, "-m", "tests.multidevice.multihost_worker", str(pid), str(port),
               str(out), "--requests", str(REQUESTS), *extra]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs, codes = [], []
    for p in reversed(procs):   # process 0 first
        try:
            log, _ = p.communicate(timeout=WALL_LIMIT_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"a process hung for {WALL_LIMIT_S}s")
        logs.append(log)
        codes.append(p.returncode)
    result = json.loads(out.read_text()) if out.exists() else {}
    return codes, result, logs


def single_process_tokens(model_dir: Path) -> dict[str, list[int]]:
    mesh = make_mesh()
    params = jax.tree_util.tree_map(np.asarray, tiny_params(TINY, seed=11))
    cfg = MULTIHOST_ENGINE
    runner = ModelRunner(params, TINY, mesh, num_blocks=cfg.scheduler.num_kv_blocks,
                         block_size=cfg.scheduler.block_size,
                         max_num_seqs=cfg.scheduler.max_num_seqs,
                         buckets=cfg.bucket_plan)
    runner.warmup()
    engine = LLMEngine(params, TINY, Tokenizer.load(model_dir), mesh, cfg, runner=runner)
    work = [(0, r) for _, r in workload(TINY.vocab_size)][:REQUESTS]   # all added at once
    [out] = run_workload([engine], work)
    return {rid: ids for rid, (ids, _) in out.items()}


def test_two_processes_serve_the_single_process_tokens(tmp_path, model_dir) -> None:
    codes, result, logs = run_pair(tmp_path, model_dir)
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    expected = single_process_tokens(model_dir)
    assert result["tokens"] == expected
    assert "process 1 followed" in logs[1]
    print(f"two processes: {sum(map(len, expected.values()))} tokens identical to one process, "
          f"{result['calls']} steps; {logs[1].strip().splitlines()[-1]}")


def test_dead_process_fails_process0_within_seconds(tmp_path, model_dir) -> None:
    """Process 1 dies (os._exit) after three calls: process 0's next collective raises at once
    instead of hanging, and process 0 reports it and exits."""
    start = time.monotonic()
    codes, result, logs = run_pair(tmp_path, model_dir, "--die-after", "3")
    assert codes[1] == 3, logs[1][-3000:]
    assert codes[0] == 2, logs[0][-3000:]
    assert result["error"], result
    assert len(result["tokens"]) < REQUESTS or any(
        len(v) < 2 for v in result["tokens"].values())   # it stopped early
    assert result["seconds"] < 15, result["seconds"]
    print(f"process 1 died: process 0 raised after {result['seconds']:.1f}s of serving: "
          f"{result['error'][:160]} (whole run {time.monotonic() - start:.0f}s)")
