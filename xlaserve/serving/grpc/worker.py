"""`xlaserve worker`: one model's local engine behind the gRPC server (server.py), the
replica a front-end router reaches through `RemoteEngine`.  The credential flags are checked
before the engine is built (that takes minutes); a split role (`--role prefill|decode`) is
refused on a multi-process layout before the job is joined."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from xlaserve.serving.config_file import load_serve_config, with_model_overrides
from xlaserve.serving.disagg.transfer import PrefixFetcher
from xlaserve.serving.grpc.auth import DEFAULT_TOKEN_ENV, WorkerAuth, channel_credentials
from xlaserve.serving.grpc.server import ROLES, start_grpc_server
from xlaserve.serving.telemetry import Telemetry


def _parse_worker_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="xlaserve worker",
        epilog="Credentials (see xlaserve/serving/grpc/auth.py): without a token or "
               "--tls-client-ca the worker binds loopback only; beyond loopback it needs TLS.")
    p.add_argument("--config", required=True)
    p.add_argument("--model", required=True, help="model name or name@version in the config")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--role", choices=ROLES, default="both",
                   help="the part of split requests it takes (serving/disagg/): prefill "
                        "(prompt to first token, exports KV), decode (fetches KV, decodes), "
                        "both (either, and whole requests)")
    p.add_argument("--dtype", help="weight dtype (auto | float32 | bfloat16 | float16; auto: "
                                   "float32 on CPU, bfloat16 on GPU): sets the model's dtype")
    p.add_argument("--tls-cert", default="", metavar="PEM",
                   help="certificate (chain): serve TLS")
    p.add_argument("--tls-key", default="", metavar="PEM", help="private key of --tls-cert")
    p.add_argument("--tls-client-ca", default="", metavar="PEM",
                   help="CA certificate: require client certificates it signed (mTLS)")
    p.add_argument("--token-env", metavar="NAME",
                   help=f"environment variable holding the bearer token every call must "
                        f"carry (default: ${DEFAULT_TOKEN_ENV}, if set; a NAME given here "
                        f"must be set)")
    return p.parse_args(argv)


async def _serve_worker(args: argparse.Namespace, auth: WorkerAuth) -> None:
    from xlaserve.serving.disagg.workers import refuse_multiprocess_worker
    from xlaserve.serving.engine.factory import local_engines
    from xlaserve.sharding.distributed import DistributedConfig

    loaded, table = load_serve_config(args.config)
    layout = DistributedConfig.resolve(table)
    refuse_multiprocess_worker(args.role, layout.num_processes if layout else 1)
    config = with_model_overrides(loaded, dtype=args.dtype)
    matches = [m for m in config.models if args.model in (m.id, m.name)]
    if not matches:
        raise ValueError(f"--model {args.model!r} not in {[m.id for m in config.models]}")
    m = matches[0]
    engines = await local_engines(m)
    if len(engines) != 1:
        raise ValueError(f"models[{m.id}]: a worker serves one replica, the factory "
                         f"built {len(engines)} (engine_args.mesh.replicas)")
    engine = engines[0]
    shutdown = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, shutdown.set)
    start = getattr(engine, "start", None)
    if start is not None:
        await start()
    # a decode worker dials the prefill workers it fetches KV from as the front end dials
    # its workers: the [grpc] table of the same config
    fetcher = PrefixFetcher(lambda target: channel_credentials(config.grpc, target))
    telemetry = Telemetry.from_config(config.tracing)
    server, _, watcher = await start_grpc_server(
        {m.name: engine}, f"{args.host}:{args.port}", auth, telemetry, fetcher, args.role)
    try:
        await shutdown.wait()
    finally:
        watcher.cancel()
        await server.stop(5)
        telemetry.shutdown()


def worker_main(argv: list[str] | None = None) -> int:
    """`xlaserve worker --config C --model NAME[@VERSION] [--host H] [--port P] [--tls-cert
    PEM --tls-key PEM [--tls-client-ca PEM]] [--token-env NAME]`: check the credentials, then
    build the model's local engine (its `engine` factory in the config) and serve it over
    gRPC.  Exit code 2 for a bad flag, config or credential."""
    args = _parse_worker_args(argv)
    try:
        # the credentials the flags name, and a bind they make safe, before the engine
        # (that takes minutes to build)
        auth = WorkerAuth.load(args.tls_cert, args.tls_key, args.tls_client_ca, args.token_env)
        auth.check_bind(args.host)
        asyncio.run(_serve_worker(args, auth))
    except (ValueError, FileNotFoundError) as e:
        print(f"xlaserve worker: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
