"""`jax.experimental.transfer` between two processes on loopback, against the split's gRPC
handoff (BENCHMARKS.md "Prefill/decode split"): one process offers `--reps` pulls of a
prompt's KV (k and v of `--tokens` tokens, SmolLM2's float32 layout [30, n, 16, 3, 64]), the
other pulls them one after another and prints each pull's time and rate.

    python -m xlaserve.bench.jax_transfer [--tokens 1024] [--reps 6] [--no-transport-addresses]

Raw device-buffer pulls only: no paged-cache gather or scatter, unlike an ExportKV fetch.
`--no-transport-addresses` starts the transfer servers as `start_transfer_server(client)`
does by default, which on jax 0.10.2 (CPU) aborts the offering process
(`Check failed: num_sys_refs_ != 0` in socket-server.cc).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYERS, BLOCK, KV_HEADS, HEAD_DIM = 30, 16, 3, 64


def _server(transport: bool):  # the process's transfer server
    import jax
    from jax.experimental import transfer

    client = jax.devices()[0].client
    if transport:
        return transfer.start_transfer_server(client, "127.0.0.1:0", ["127.0.0.1:0"])
    return transfer.start_transfer_server(client)


def _offer(args: argparse.Namespace) -> None:
    import jax.numpy as jnp

    server = _server(args.transport)
    shape = (LAYERS, args.tokens // BLOCK, BLOCK, KV_HEADS, HEAD_DIM)
    for i in range(args.reps):
        k = jnp.full(shape, float(i), jnp.float32)
        server.await_pull(100 + i, [k, k + 0.5])
    Path(args.address_file).write_text(server.address())
    time.sleep(args.linger_s)   # until the puller is done (it is killed then)


def _pull(args: argparse.Namespace) -> None:
    import jax
    import jax.numpy as jnp

    server = _server(args.transport)
    path = Path(args.address_file)
    while not path.exists() or not path.read_text():
        time.sleep(0.05)
    connection = server.connect(path.read_text())
    shape = (LAYERS, args.tokens // BLOCK, BLOCK, KV_HEADS, HEAD_DIM)
    spec = jax.ShapeDtypeStruct(shape, jnp.float32,
                                sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    for i in range(args.reps):
        t0 = time.monotonic()
        k, v = jax.block_until_ready(connection.pull(100 + i, [spec, spec]))
        dt = time.monotonic() - t0
        ok = float(k[0, 0, 0, 0, 0]) == i and float(v[-1, -1, -1, -1, -1]) == i + 0.5
        print(f"pull {i}: {2 * k.nbytes / 1e6:.1f} MB in {dt:.4f} s "
              f"({2 * k.nbytes / dt / 1e6:.0f} MB/s), contents {'ok' if ok else 'WRONG'}",
              flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xlaserve.bench.jax_transfer")
    p.add_argument("--tokens", type=int, default=1024, help="a multiple of 16")
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--no-transport-addresses", dest="transport", action="store_false")
    p.add_argument("--role", choices=("offer", "pull"), help=argparse.SUPPRESS)
    p.add_argument("--address-file", help=argparse.SUPPRESS)
    p.add_argument("--linger-s", type=float, default=120.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tokens < BLOCK or args.tokens % BLOCK:
        p.error(f"--tokens {args.tokens}: a positive multiple of {BLOCK}")
    if args.role == "offer":
        _offer(args)
        return 0
    if args.role == "pull":
        _pull(args)
        return 0
    with tempfile.TemporaryDirectory() as d:
        flags = [sys.executable, "-m", "xlaserve.bench.jax_transfer", "--tokens",
                 str(args.tokens), "--reps", str(args.reps), "--address-file", f"{d}/address"]
        if not args.transport:
            flags.append("--no-transport-addresses")
        offer = subprocess.Popen([*flags, "--role", "offer"])
        try:
            code = subprocess.run([*flags, "--role", "pull"], timeout=300).returncode
        finally:
            offer.kill()
            offer.wait()
    if offer.returncode not in (0, -9):
        print(f"the offering process ended with {offer.returncode}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
