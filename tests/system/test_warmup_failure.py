"""A server whose only engine fails its warm-up exits non-zero, naming the cause, instead of
staying up and never ready."""

from __future__ import annotations

import subprocess
import sys

from tests.multidevice.engine_workload import save_model_folder
from tests.serving.engine.conftest import TINY_CONFIG
from tests.system.conftest import ROOT, free_port
from xlaserve.models.llama import init_params

CONFIG = """
[server]
host = "127.0.0.1"
port = {port}

[auth]
mode = "none"

[[models]]
name = "tiny"
path = "{path}"
engine = "tests.system.failing_engine:build"
[models.engine_args]
max_model_len = 64
num_kv_blocks = 8
max_num_seqs = 2
max_num_batched_tokens = 32
max_prefill_chunk = 32
min_table_width = 4
"""


def test_a_failed_warm_up_stops_the_server(tmp_path, model_dir) -> None:
    folder = save_model_folder(tmp_path / "tiny", init_params(TINY_CONFIG, 0), TINY_CONFIG,
                               model_dir)
    config = tmp_path / "server.toml"
    config.write_text(CONFIG.format(port=free_port(), path=folder))
    done = subprocess.run([sys.executable, "-m", "xlaserve.cli", "serve", "--config",
                           str(config)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "stopping the server: warm-up failed (RuntimeError: injected warm-up failure)" \
        in done.stderr, done.stderr[-2000:]
    assert "xlaserve serve: error: warm-up failed" in done.stderr
