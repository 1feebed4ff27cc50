"""System (b): static batching on the engine's own ModelRunner (same compiled buckets).

    for each batch of B requests, in arrival order:
        reserve   each row's blocks for prompt + the batch's longest output, up front
        prefill   every row's prompt in chunks of `chunk` tokens (the engine's largest); the
                  rows' chunks of one round share calls, as many as fit the largest token
                  bucket; the last chunk samples the row's first token
        decode    all B rows together, one token per step, until the batch's longest request
                  ends: a row whose request is done keeps decoding (its tokens are dropped),
                  so it holds its row and its blocks to the end; that is the baseline
        free      the batch's blocks

Decode steps are pipelined like the engine's: step k+1 is launched (its inputs are the tokens
still on device) before step k's tokens are read back.  A request completes when its last own
token reaches the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xlaserve.bench.metrics import Clock, KVWasteMeter, RequestOutcome, SystemResult
from xlaserve.bench.workload import BenchRequest, Workload
from xlaserve.serving.runner.compile_counter import CompileCounter
from xlaserve.serving.runner.calls import CallResult
from xlaserve.serving.runner.runner import ModelRunner
from xlaserve.serving.scheduler.step_plan import PENDING_TOKEN, ScheduledSeq


class BlockAllocator:
    """A free list over the runner's blocks 1 .. num_blocks - 1 (block 0 is the null block)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise ValueError(f"static batch needs {n} more KV blocks, {len(self._free)} free "
                             f"of {self.num_blocks - 1}: lower --batch")
        return [self._free.pop() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        assert not set(blocks) & set(self._free), "double free"
        self._free.extend(reversed(blocks))


@dataclass
class _Row:
    request: BenchRequest
    owner: str                      # owns its token cell (runner.cells): `slot-{n}`
    table: list[int]                # reserved for prompt + the batch's longest output
    written: int = 0                # positions whose KV is in the cache
    tokens: list[int] = field(default_factory=list)
    done_at: float | None = None

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt_token_ids

    @property
    def own_positions(self) -> int:
        """Positions of this request's own tokens that ever need KV (not the last output)."""
        return len(self.prompt) + self.request.num_output_tokens - 1


def _blocks(n_tokens: int, block_size: int) -> int:
    return max(1, -(-n_tokens // block_size))


class StaticBatcher:
    def __init__(self, runner: ModelRunner, batch_size: int, chunk: int):
        if not 1 <= batch_size <= runner.max_num_seqs:
            raise ValueError(f"--batch {batch_size}: the runner has rows for 1.."
                             f"{runner.max_num_seqs}")
        if not 1 <= chunk <= runner.buckets.max_tokens:
            raise ValueError(f"prefill chunk {chunk} exceeds the largest token bucket "
                             f"{runner.buckets.max_tokens}")
        self.runner = runner
        self.batch_size = batch_size
        self.chunk = chunk
        self.allocator = BlockAllocator(runner.num_blocks)

    def run(self, workload: Workload, warmup_s: float = 0.0) -> SystemResult:
        meter = KVWasteMeter()
        outcomes: dict[str, RequestOutcome] = {}
        steps = 0
        with CompileCounter() as compiles:
            clock = Clock()
            reqs = workload.requests
            for b0 in range(0, len(reqs), self.batch_size):
                rows = self._reserve(reqs[b0:b0 + self.batch_size])
                try:
                    steps += self._run_batch(rows, clock, meter)
                finally:
                    for row in rows:
                        self.allocator.release(row.table)
                        self.runner.cells.release(row.owner)
                for row in rows:
                    assert row.done_at is not None
                    outcomes[row.request.request_id] = RequestOutcome(
                        row.request.request_id, tuple(row.tokens), row.done_at)
            wall = clock()
            meter.sample(wall, 0, 0)
            meter.finish(wall)
        return SystemResult(f"static(B={self.batch_size})", wall, outcomes, meter.waste,
                            meter.peak_allocated, compiles.count, warmup_s,
                            {"steps": steps})

    # -- one batch -----------------------------------------------------------------------------

    def _reserve(self, batch: tuple[BenchRequest, ...]) -> list[_Row]:
        longest = max(r.num_output_tokens for r in batch)
        bs = self.runner.block_size
        rows: list[_Row] = []
        try:
            for i, r in enumerate(batch):
                need = _blocks(len(r.prompt_token_ids) + longest - 1, bs)
                rows.append(_Row(r, f"slot-{i + 1}", self.allocator.allocate(need)))
        except ValueError:
            for row in rows:
                self.allocator.release(row.table)
            raise
        return rows

    def _sample_waste(self, rows: list[_Row], meter: KVWasteMeter, now: float) -> None:
        bs = self.runner.block_size
        allocated = sum(len(row.table) * bs for row in rows)
        own = sum(min(row.written, row.own_positions) for row in rows)
        meter.sample(now, allocated, allocated - own)

    def _accept(self, rows: list[_Row], call: CallResult, clock: Clock,
                index: list[int] | None = None) -> None:
        """Read a call's tokens back: row `rows[i]` sampled at call row `index[i]` (default i);
        a row takes a token only while its request still wants one."""
        host = call.fetch()
        now = clock()
        for i, row in enumerate(rows):
            if len(row.tokens) < row.request.num_output_tokens:
                row.tokens.append(int(host["tokens"][i if index is None else index[i]]))
                if len(row.tokens) == row.request.num_output_tokens:
                    row.done_at = now

    def _run_batch(self, rows: list[_Row], clock: Clock, meter: KVWasteMeter) -> int:
        runner, bs = self.runner, self.runner.block_size
        most_tokens, most_rows = runner.buckets.max_tokens, runner.buckets.row_sizes[-1]
        steps = 0
        # Prefill: round after round, every row with prompt left feeds its next chunk.
        while any(row.written < len(row.prompt) for row in rows):
            calls: list[tuple[CallResult, list[tuple[int, _Row]]]] = []
            part: list[tuple[_Row, ScheduledSeq]] = []

            def launch() -> None:
                call = runner.run([inp for _, inp in part])
                calls.append((call, [(j, row) for j, (row, inp) in enumerate(part)
                                     if inp.sample]))
                part.clear()

            for row in rows:
                w = row.written
                n = min(self.chunk, len(row.prompt) - w)
                if n == 0:
                    continue
                inp = runner.row(row.owner, row.prompt[w:w + n], w,
                                 row.table[:_blocks(w + n, bs)], sample=w + n == len(row.prompt))
                if part and (sum(i.num_tokens for _, i in part) + n > most_tokens
                             or len(part) == most_rows):
                    launch()
                    steps += 1
                part.append((row, inp))
                row.written = w + n
            launch()
            steps += 1
            self._sample_waste(rows, meter, clock())
            for call, sampled in calls:
                if sampled:
                    self._accept([row for _, row in sampled], call, clock,
                                 [j for j, _ in sampled])
        # Decode: all rows, until the batch's longest request has all its tokens.
        longest = max(row.request.num_output_tokens for row in rows)
        previous: CallResult | None = None
        for k in range(1, longest):
            inputs = [runner.row(row.owner, (PENDING_TOKEN,), len(row.prompt) + k - 1,
                                 row.table[:_blocks(len(row.prompt) + k, bs)])
                      for row in rows]
            call = runner.run(inputs)
            for row in rows:
                row.written += 1
            steps += 1
            self._sample_waste(rows, meter, clock())
            if previous is not None:
                self._accept(rows, previous, clock)
            previous = call
        if previous is not None:
            self._accept(rows, previous, clock)
        return steps
