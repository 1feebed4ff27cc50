"""One process of a two-process engine on loopback (run by test_multihost.py, not by pytest).

    python -m tests.multidevice.multihost_worker PROCESS_ID PORT OUT_JSON [--die-after N]

Two CPU devices per process (XLA_FLAGS set by the caller), gloo collectives, one pipeline=2 x
tensor=2 mesh over all four devices.  Process 0 runs the engine on the workload and writes the
generated tokens to OUT_JSON; process 1 follows.  With --die-after N, process 1 exits abruptly
after running N calls; process 0 then writes the error it got and how long it took to get it."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import jax
import numpy as np

from xlaserve.sharding.distributed import DistributedConfig, initialize


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("process_id", type=int)
    ap.add_argument("port", type=int)
    ap.add_argument("out")
    ap.add_argument("--die-after", type=int, default=None)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--peer-timeout", type=float, default=20.0)
    args = ap.parse_args()
    initialize(DistributedConfig(f"127.0.0.1:{args.port}", 2, args.process_id,
                                 heartbeat_timeout_s=10))
    from tests.multidevice.engine_workload import MULTIHOST_ENGINE as ENGINE
    from tests.multidevice.engine_workload import workload
    from tests.multidevice.scenarios import TINY, tiny_params
    from xlaserve.serving.engine.engine import LLMEngine
    from xlaserve.serving.runner.runner import ModelRunner
    from xlaserve.serving.tokenizer import Tokenizer
    from xlaserve.sharding.mesh import MeshConfig, make_mesh

    assert jax.process_count() == 2 and jax.device_count() == 4, jax.devices()
    mesh = make_mesh(MeshConfig(pipeline=2, tensor=2))
    params = jax.tree_util.tree_map(np.asarray, tiny_params(TINY, seed=11))
    runner = ModelRunner(params, TINY, mesh, num_blocks=ENGINE.scheduler.num_kv_blocks,
                         block_size=ENGINE.scheduler.block_size,
                         max_num_seqs=ENGINE.scheduler.max_num_seqs,
                         buckets=ENGINE.bucket_plan, peer_timeout_s=args.peer_timeout)
    runner.warmup()
    if args.process_id != 0:
        if args.die_after is not None:
            launch, calls = runner._launch_forward, [0]

            def dying(host):
                if calls[0] == args.die_after:
                    os._exit(3)   # no goodbye: as if the host had crashed
                calls[0] += 1
                return launch(host)

            runner._launch_forward = dying
        n = runner.follow()
        print(f"process 1 followed {n} calls", flush=True)
        jax.distributed.shutdown()
        return

    engine = LLMEngine(params, TINY, Tokenizer.load(os.environ["XLASERVE_MODEL_DIR"]), mesh,
                       ENGINE, runner=runner)
    result: dict[str, object] = {"tokens": {}}
    start = time.monotonic()
    try:
        for request in [r for _, r in workload(TINY.vocab_size)][: args.requests]:
            engine.add(request)
        while engine.has_work():
            for event in engine.step():
                result["tokens"].setdefault(event.request_id, []).extend(event.token_ids)
        runner.close()
        result["calls"] = engine.num_steps
    except Exception as e:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    result["seconds"] = time.monotonic() - start
    with open(args.out, "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    if "error" in result:
        os._exit(2)   # a peer is gone: jax's shutdown barrier would wait for it
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
