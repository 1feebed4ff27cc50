"""A fake engine whose outputs are computed by hand: it echoes the prompt's token ids in
reverse (starting `seed % len(prompt)` further along when a seed is given), one token per step
after `prefill_delay`, each step `token_delay` seconds.  An EOS id among them ends the request
with "stop"; stop strings end it with "stop" and are cut off; else "length" at max_tokens.
With `reply`, it answers that text instead (then EOS), for tests of what the server makes of
a model's output.  Logprob of the i-th output token: -(i + 1) / 10; its top-k: the next k ids
with -(i+1)/10 - j/100.

It books KV blocks like the real one (ceil(tokens / block_size) per request while it runs) so
tests can check that every block comes back (`blocks_in_use == 0`), and runs at most
`max_running` requests at once, the rest waiting.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

from xlaserve.serving.engine_api import EngineStats, ServiceCosts
from xlaserve.serving.tokenizer import IncrementalDetokenizer, Tokenizer
from xlaserve.serving.types import EngineEvent, GenerationRequest, TokenLogprob, Usage


def expected_ids(prompt: list[int], max_tokens: int, seed: int | None = None) -> list[int]:
    start = (seed or 0) % len(prompt)
    rev = prompt[::-1]
    return [rev[(start + i) % len(rev)] for i in range(max_tokens)]


class FakeEngine:
    def __init__(self, tokenizer: Tokenizer, model_name: str = "fake", max_model_len: int = 512,
                 token_delay: float = 0.0, prefill_delay: float = 0.0, max_running: int = 64,
                 block_size: int = 16, kv_blocks_total: int = 4096, fail_token: int | None = None,
                 reply: str | None = None):
        self.tokenizer = tokenizer
        # reply: every request answers this text's ids (then an EOS), not the reversed prompt
        self.reply_ids = None if reply is None else [
            *tokenizer.encode(reply, add_special_tokens=False), tokenizer.eos_ids[0]]
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.token_delay = token_delay
        self.prefill_delay = prefill_delay
        self.max_running = max_running
        self.block_size = block_size
        self.kv_blocks_total = kv_blocks_total
        self.fail_token = fail_token
        self.ready = True
        self.blocks_in_use = 0
        self.running: set[str] = set()
        self.waiting = 0
        self.abort_calls: list[str] = []
        self.submitted: list[GenerationRequest] = []
        self.finished: dict[str, str] = {}          # request id -> finish_reason
        self._abort_flags: set[str] = set()
        self._abort_events: dict[str, asyncio.Event] = {}
        self._slots: asyncio.Semaphore | None = None

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.running), num_waiting=self.waiting,
                           kv_blocks_total=self.kv_blocks_total,
                           kv_blocks_used=self.blocks_in_use, num_finished=len(self.finished))

    def service_costs(self) -> ServiceCosts:
        """Its steps as admission sees them: a full batch of `max_running` every
        `token_delay` (a millisecond at least), and `prefill_delay` for a 16-token prompt."""
        return ServiceCosts(self.max_running, max(self.token_delay, 1e-3),
                            16 / self.prefill_delay if self.prefill_delay else 1e6)

    @property
    def aborted(self) -> set[str]:
        """Requests that ended early: abort() was called, or their stream was closed."""
        return {rid for rid, f in self.finished.items() if f == "abort"}

    async def abort(self, request_id: str) -> None:
        self.abort_calls.append(request_id)
        if request_id not in self.finished:
            self._abort_flags.add(request_id)
            if request_id in self._abort_events:
                self._abort_events[request_id].set()

    async def _sleep(self, rid: str, delay: float) -> None:
        """Sleep, but wake at once when the request is aborted (like the next engine step)."""
        ev = self._abort_events.setdefault(rid, asyncio.Event())
        if rid in self._abort_flags:
            return
        try:
            await asyncio.wait_for(ev.wait(), delay)
        except TimeoutError:
            pass

    def _blocks(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.block_size)

    async def submit(self, request: GenerationRequest) -> AsyncIterator[EngineEvent]:
        self.submitted.append(request)
        rid, s, prompt = request.request_id, request.sampling, request.prompt_token_ids
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_running)
        held = 0
        acquired = False
        finish: str | None = None
        out: list[int] = []
        try:
            self.waiting += 1
            try:
                await self._slots.acquire()
                acquired = True
            finally:
                self.waiting -= 1
            self.running.add(rid)
            held = self._blocks(len(prompt))
            self.blocks_in_use += held
            await self._sleep(rid, self.prefill_delay)
            detok = IncrementalDetokenizer(self.tokenizer, prompt)
            text = ""
            ids = (self.reply_ids[:s.max_tokens] if self.reply_ids is not None
                   else expected_ids(prompt, s.max_tokens, s.seed))
            for i, tid in enumerate(ids):
                if rid in self._abort_flags:
                    finish = "abort"
                    break
                if self.fail_token is not None and tid == self.fail_token:
                    finish = "error"
                    break
                if tid in self.tokenizer.eos_ids and not s.ignore_eos:
                    finish = "stop"
                    break
                await self._sleep(rid, self.token_delay)
                if rid in self._abort_flags:
                    finish = "abort"
                    break
                out.append(tid)
                need = self._blocks(len(prompt) + len(out))
                self.blocks_in_use += need - held
                held = need
                delta = detok.add(tid)
                lp = ()
                if s.logprobs is not None:
                    base = -(i + 1) / 10
                    lp = (TokenLogprob(tid, base, tuple((tid + j + 1, base - (j + 1) / 100)
                                                        for j in range(s.logprobs))),)
                hit = next((x for x in s.stop if x in text + delta), None)
                if hit is not None:
                    cut = (text + delta).index(hit)
                    yield EngineEvent(rid, (tid,), (text + delta)[len(text):cut], lp)
                    finish = "stop"
                    break
                text += delta
                if len(out) == s.max_tokens:
                    delta += detok.flush()
                    yield EngineEvent(rid, (tid,), delta, lp)
                    finish = "length"
                    break
                yield EngineEvent(rid, (tid,), delta, lp)
            finish = finish or "length"
            yield EngineEvent(rid, (), "", (), finish, Usage(len(prompt), len(out)),
                              "fake failure" if finish == "error" else None)
        finally:
            self.finished.setdefault(rid, finish or "abort")
            self.blocks_in_use -= held
            self.running.discard(rid)
            self._abort_flags.discard(rid)
            self._abort_events.pop(rid, None)
            if acquired:
                self._slots.release()


def expected_output(tokenizer: Tokenizer, prompt: list[int], max_tokens: int,
                    seed: int | None = None) -> tuple[str, str, int]:
    """(text, finish_reason, completion tokens) the fake engine produces, stop strings aside."""
    out = []
    for tid in expected_ids(prompt, max_tokens, seed):
        if tid in tokenizer.eos_ids:
            return tokenizer.decode(out), "stop", len(out)
        out.append(tid)
    return tokenizer.decode(out), "length", len(out)


def build(model: object) -> FakeEngine:
    """Engine factory for configs (`engine = "fake_engine:build"`): tokenizer from the model's
    `path`, FakeEngine keyword arguments from its `engine_args`."""
    return FakeEngine(Tokenizer.load(model.path), model.name,  # type: ignore[attr-defined]
                      **dict(model.engine_args))  # type: ignore[attr-defined]
