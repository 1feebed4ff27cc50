"""A prompt's KV between workers over gRPC: `PrefixKV` <-> a stream of `KVBlocks` messages
(a few whole blocks each, under gRPC's 4 MiB default message limit), and the decode worker's
fetch from the prefill worker's ExportKV.

    decode worker (Generate with kv_source)          prefill worker (ExportKV)
    fetch_prefix(source, prompt, tenant) ── call ──> engine thread: export_prefix -> PrefixKV
        <── KVBlocks(first_block=0, n blocks) ──     split into messages of <= MAX_MESSAGE
        <── KVBlocks(first_block=n, ...) ───────     bytes (k and v), in order
    -> PrefixKV -> engine thread: import_prefix
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import grpc
import numpy as np

from xlaserve.serving.engine.kv_handoff import PrefixKV
from xlaserve.serving.grpc import xlaserve_pb2 as pb
from xlaserve.serving.grpc import xlaserve_pb2_grpc as pb_grpc
from xlaserve.serving.types import KVHandoff

MAX_MESSAGE = 2 << 20   # bytes of k + v per message
FETCH_TIMEOUT_S = 60.0


def to_messages(kv: PrefixKV, max_bytes: int = MAX_MESSAGE) -> Iterator[pb.KVBlocks]:
    """`kv` as messages of whole blocks, k and v together at most `max_bytes` (at least one
    block each)."""
    n = kv.num_blocks
    per_block = max(kv.nbytes // max(n, 1), 1)
    step = max(1, max_bytes // per_block)
    for first in range(0, n, step):
        k, v = kv.k[:, first:first + step], kv.v[:, first:first + step]
        yield pb.KVBlocks(block_size=kv.block_size, first_block=first, shape=list(k.shape),
                          dtype=k.dtype.name, k=np.ascontiguousarray(k).tobytes(),
                          v=np.ascontiguousarray(v).tobytes())


def from_messages(messages: Sequence[pb.KVBlocks]) -> PrefixKV | None:
    """The PrefixKV the messages carry (None: no blocks); ValueError for messages that do
    not fit together (gaps, other shapes or dtypes)."""
    if not messages:
        return None
    ks, vs, expected = [], [], 0
    head = messages[0]
    for m in messages:
        if m.first_block != expected or m.block_size != head.block_size or m.dtype != head.dtype:
            raise ValueError(f"KV message for blocks from {m.first_block} (block_size "
                             f"{m.block_size}, {m.dtype}) after {expected} blocks of "
                             f"{head.block_size}, {head.dtype}")
        shape = tuple(m.shape)
        ks.append(np.frombuffer(m.k, np.dtype(m.dtype)).reshape(shape))
        vs.append(np.frombuffer(m.v, np.dtype(m.dtype)).reshape(shape))
        expected += shape[1]
    return PrefixKV(head.block_size, np.concatenate(ks, axis=1), np.concatenate(vs, axis=1))


class PrefixFetcher:
    """A decode worker's client of other workers' ExportKV, one channel per source, dialled
    with `credentials(target)` (the front end's [grpc] settings: the same hop)."""

    def __init__(self, credentials: Callable[[str], grpc.ChannelCredentials | None]):
        self.credentials = credentials
        self._stubs: dict[str, pb_grpc.GenerationStub] = {}

    def _stub(self, target: str) -> pb_grpc.GenerationStub:
        if target not in self._stubs:
            creds = self.credentials(target)
            channel = (grpc.aio.secure_channel(target, creds) if creds is not None
                       else grpc.aio.insecure_channel(target))
            self._stubs[target] = pb_grpc.GenerationStub(channel)
        return self._stubs[target]

    async def fetch(self, target: str, model: str, prompt: Sequence[int], tenant: str
                    ) -> tuple[PrefixKV | None, KVHandoff]:
        """The KV `target` still holds for `prompt`'s full blocks, and what moving it took."""
        t0 = time.monotonic()
        call = self._stub(target).ExportKV(
            pb.ExportKVRequest(model=model, prompt_token_ids=list(prompt), tenant=tenant),
            timeout=FETCH_TIMEOUT_S)
        messages = [m async for m in call]
        kv = from_messages(messages)
        nbytes = 0 if kv is None else kv.nbytes
        return kv, KVHandoff(0 if kv is None else kv.num_blocks, nbytes, time.monotonic() - t0)
