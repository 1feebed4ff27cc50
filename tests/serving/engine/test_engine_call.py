"""`ThreadedEngine.call` (fn run on the engine thread between steps): a call whose caller was
cancelled before the thread came to it is skipped, and the thread goes on serving (before, its
result set on the cancelled future raised InvalidStateError on the engine thread)."""

from __future__ import annotations

import asyncio

from tests.serving.engine.conftest import new_tiny_engine, request, tokens_of
from xlaserve.serving.engine.threaded_engine import ThreadedEngine


def test_a_cancelled_call_is_skipped_and_the_engine_serves_on(warm_tiny):
    front = ThreadedEngine(new_tiny_engine(warm_tiny))
    ran: list[str] = []

    async def main() -> tuple[int, list[int]]:
        gone = asyncio.ensure_future(front.call(lambda e: ran.append("gone")))
        await asyncio.sleep(0)          # queued; the engine thread does not run yet
        gone.cancel()
        await asyncio.sleep(0)
        front.launch(warmup=False)
        blocks = await asyncio.wait_for(front.call(lambda e: e.scheduler.kv_cache.pool
                                                   .num_allocatable_blocks), 30)
        stream = front.submit(request("r", list(range(1000, 1020)), max_tokens=3,
                                      ignore_eos=True))
        return blocks, tokens_of([ev async for ev in stream])

    try:
        blocks, tokens = asyncio.run(main())
    finally:
        front.shutdown()
    assert ran == [] and blocks > 0 and len(tokens) == 3
    front.engine.scheduler.check_integrity()
