"""A prompt's KV between workers over gRPC: `PrefixKV` <-> a stream of `KVBlocks` messages
(a few whole blocks each, under gRPC's 4 MiB default message limit), and the decode worker's
fetches from the prefill worker's ExportKV.

    decode worker                                    prefill worker (ExportKV)
    PrefetchKV, while the prefill runs:
    prefetch_prefix ── ExportKV(follow=id, from h) ─> follow_export: after each of the
        <── KVBlocks(first_block=h, ...) ────────     request's steps, export_prefix of the
        <── KVBlocks(first_block=h+n, ...) ──────     blocks registered since (engine thread)
    engine thread: import_prefix of what came        ... until every full block is sent or
                                                     the request has left the worker
    Generate with kv_source (the first token known):
    adopt_prefix ── ExportKV(from h) ──> export_prefix: the blocks the decode side still lacks
        <── KVBlocks(first_block=h, n blocks) ──     split into messages of <= MAX_MESSAGE
        <── KVBlocks(first_block=h+n, ...) ─────     bytes (k and v), in order
    -> PrefixKV -> engine thread: import_prefix

h: the leading blocks the decode worker already holds (cached_blocks), never sent again.
Nothing is pinned on either side (engine/kv_handoff.py): the follow reads the request's own
blocks while it runs, and a decode side that never asks leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence

import grpc
import numpy as np

from xlaserve.serving.engine.kv_handoff import (
    PrefixKV,
    cached_blocks,
    export_prefix,
    import_prefix,
)
from xlaserve.serving.engine_api import AsyncEngine
from xlaserve.serving.grpc import xlaserve_pb2 as pb
from xlaserve.serving.grpc import xlaserve_pb2_grpc as pb_grpc
from xlaserve.serving.types import KVHandoff

log = logging.getLogger(__name__)

MAX_MESSAGE = 2 << 20   # bytes of k + v per message
FETCH_TIMEOUT_S = 60.0
FOLLOW_POLL_S = 0.005   # a follow's pause after an export that found nothing new
FOLLOW_START_S = 10.0   # how long a follow waits for its request to reach the worker
EngineCall = Callable[[Callable], Awaitable]   # ThreadedEngine.call


def to_messages(kv: PrefixKV, max_bytes: int = MAX_MESSAGE) -> Iterator[pb.KVBlocks]:
    """`kv` as messages of whole blocks, k and v together at most `max_bytes` (at least one
    block each)."""
    n = kv.num_blocks
    per_block = max(kv.nbytes // max(n, 1), 1)
    step = max(1, max_bytes // per_block)
    for first in range(0, n, step):
        k, v = kv.k[:, first:first + step], kv.v[:, first:first + step]
        yield pb.KVBlocks(block_size=kv.block_size, first_block=kv.first_block + first,
                          shape=list(k.shape),
                          dtype=k.dtype.name, k=np.ascontiguousarray(k).tobytes(),
                          v=np.ascontiguousarray(v).tobytes())


def from_messages(messages: Sequence[pb.KVBlocks]) -> PrefixKV | None:
    """The PrefixKV the messages carry, from the first one's first_block on (None: no
    blocks); ValueError for messages that do not fit together (gaps, other shapes or
    dtypes)."""
    if not messages:
        return None
    head = messages[0]
    ks, vs, expected = [], [], head.first_block
    for m in messages:
        if m.first_block != expected or m.block_size != head.block_size or m.dtype != head.dtype:
            raise ValueError(f"KV message for blocks from {m.first_block} (block_size "
                             f"{m.block_size}, {m.dtype}) after {expected} blocks of "
                             f"{head.block_size}, {head.dtype}")
        shape = tuple(m.shape)
        ks.append(np.frombuffer(m.k, np.dtype(m.dtype)).reshape(shape))
        vs.append(np.frombuffer(m.v, np.dtype(m.dtype)).reshape(shape))
        expected += shape[1]
    return PrefixKV(head.block_size, np.concatenate(ks, axis=1), np.concatenate(vs, axis=1),
                    head.first_block)


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

    async def fetch(self, target: str, model: str, prompt: Sequence[int], tenant: str,
                    first_block: int = 0) -> tuple[PrefixKV | None, KVHandoff]:
        """The KV `target` still holds for `prompt`'s full blocks from `first_block` on, and
        what moving it took."""
        t0 = time.monotonic()
        kv = from_messages([m async for m in self.export(target, model, prompt, tenant,
                                                         first_block)])
        moved = (0, 0) if kv is None else (kv.num_blocks, kv.nbytes)
        return kv, KVHandoff(*moved, time.monotonic() - t0)

    def export(self, target: str, model: str, prompt: Sequence[int], tenant: str,
               first_block: int = 0, follow_request_id: str = ""
               ) -> grpc.aio.UnaryStreamCall:
        """`target`'s ExportKV call (a stream of KVBlocks), following the running request
        `follow_request_id` when given."""
        return self._stub(target).ExportKV(
            pb.ExportKVRequest(model=model, prompt_token_ids=list(prompt), tenant=tenant,
                               first_block=first_block, follow_request_id=follow_request_id),
            timeout=FETCH_TIMEOUT_S)


async def follow_export(call: EngineCall, ids: Sequence[int], tenant: str, first_block: int,
                        running: Callable[[], bool | None]) -> AsyncIterator[PrefixKV]:
    """The prompt's full blocks from `first_block` on, as a request running here registers
    them (`running()`: True while it is on this worker, False once it has left, None if it
    has not been here): one export per engine step (a call waits for the step in flight),
    of the blocks registered since the last.  Ends once every full block is sent, after one
    last export once the request has left (finished or aborted: its blocks are cached free
    by then, or evicted), or when it has not shown up within FOLLOW_START_S."""
    sent, t0 = first_block, time.monotonic()
    while True:
        state = running()
        kv = await call(lambda e, start=sent: export_prefix(e, ids, tenant, start))
        if kv.num_blocks:
            yield kv
            sent += kv.num_blocks
        if sent >= len(ids) // kv.block_size or state is False or (
                state is None and time.monotonic() - t0 > FOLLOW_START_S):
            return
        if not kv.num_blocks:
            await asyncio.sleep(FOLLOW_POLL_S)


async def prefetch_prefix(fetcher: PrefixFetcher, engine: AsyncEngine, source: str,
                          model: str, ids: Sequence[int], tenant: str, request_id: str
                          ) -> tuple[KVHandoff, bool]:
    """Follow `request_id`'s prefill on `source`, adopting its blocks into `engine`'s prefix
    cache as they come (whatever has arrived, in one import between two of this engine's
    steps); returns what moved and whether every full block of the prompt is cached here
    now.  A failure (the source gone, the request never there) is logged: the Generate's
    own fetch or a recomputation covers the rest."""
    call = getattr(engine, "call", None)
    if call is None:
        return KVHandoff(0, 0, 0.0), False
    t0, blocks, nbytes, have = time.monotonic(), 0, 0, 0
    try:
        have = await call(lambda e: len(cached_blocks(e, ids, tenant)))
        stream = fetcher.export(source, model, ids, tenant, have, request_id)
        try:
            async with contextlib.aclosing(_batches(stream)) as batches:
                async for batch in batches:
                    kv = from_messages(batch)
                    if kv is None or kv.first_block != have + blocks:
                        raise ValueError(f"KV from block {kv and kv.first_block} after "
                                         f"{have + blocks} blocks")
                    # blocks that find no room, or whose predecessors were evicted here, are
                    # not taken: the Generate's fetch or a recomputation covers them
                    await call(lambda e, kv=kv: import_prefix(e, ids, tenant, kv))
                    blocks, nbytes = blocks + kv.num_blocks, nbytes + kv.nbytes
        finally:
            stream.cancel()
        complete = await call(lambda e: len(cached_blocks(e, ids, tenant))
                              == len(ids) // e.scheduler.config.block_size)
    except (grpc.aio.AioRpcError, ValueError, RuntimeError) as e:
        log.warning("KV prefetch from %s failed: %s", source, e)
        complete = False
    return KVHandoff(blocks, nbytes, time.monotonic() - t0), complete


async def _batches(stream: AsyncIterator[pb.KVBlocks]) -> AsyncIterator[list[pb.KVBlocks]]:
    """The stream's messages in batches: each batch is everything that arrived while the
    previous one was being imported (at least one message)."""
    queue: asyncio.Queue[pb.KVBlocks | None] = asyncio.Queue()

    async def read() -> None:
        try:
            async for m in stream:
                queue.put_nowait(m)
        finally:
            queue.put_nowait(None)

    reader = asyncio.ensure_future(read())
    try:
        while (m := await queue.get()) is not None:
            batch = [m]
            while not queue.empty() and (m := queue.get_nowait()) is not None:
                batch.append(m)
            yield batch
            if m is None:
                break
        await reader    # its error, if it failed
    finally:
        reader.cancel()


async def adopt_prefix(fetcher: PrefixFetcher, engine: AsyncEngine, source: str, model: str,
                       ids: list[int], tenant: str) -> KVHandoff | None:
    """Fetch the prompt's KV that `engine` lacks from the worker at `source` and adopt it into
    `engine`'s prefix cache.  Any failure (the source gone, its blocks evicted, an engine that
    cannot import) only means the prompt is computed here: logged, never the request's
    error."""
    call = getattr(engine, "call", None)
    if call is None:
        return None
    try:
        have = await call(lambda e: len(cached_blocks(e, ids, tenant)))
        kv, handoff = await fetcher.fetch(source, model, ids, tenant, have)
        if kv is not None:
            await call(lambda e: import_prefix(e, ids, tenant, kv))
        return handoff
    except (grpc.aio.AioRpcError, ValueError, RuntimeError) as e:
        log.warning("KV handoff from %s failed, computing the prompt here: %s", source, e)
        return None
