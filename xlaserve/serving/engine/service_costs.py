"""What the engine's steps cost, for admission's projection (`ServiceCosts`): measured once in
warm-up (`calibrate`: timed calls of a full decode batch and of one prefill chunk), then kept
current from the steps served (`CostMeter.observe`, fed by the engine with each step whose
device time the StepClock measured).

    step_s                exponential average over decode-only steps of at least 3/4 of a
                          full batch (the batch a burst runs at)
    prefill_tokens_per_s  exponential average of prompt tokens / seconds over steps that
                          prefill at least MIN_PREFILL_TOKENS (decodes riding along in such a
                          step count against it: the estimate errs on the slow side)

The current value is one frozen ServiceCosts, replaced whole, so other threads read it without
a lock.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import replace

from xlaserve.serving.engine_api import ServiceCosts
from xlaserve.serving.runner.runner import ModelRunner
from xlaserve.serving.scheduler.step_plan import ScheduledSeq

MIN_PREFILL_TOKENS = 32


class CostMeter:
    def __init__(self, max_running: int, weight: float = 0.2):
        self.weight = weight
        self.costs = ServiceCosts(max_running=max_running)

    def _mix(self, old: float, new: float) -> float:
        return new if old == 0 else old + self.weight * (new - old)

    def observe(self, rows: int, prompt_tokens: int, seconds: float) -> None:
        """A step of `rows` rows, `prompt_tokens` of them prompt tokens, took `seconds`."""
        c = self.costs
        if seconds <= 0:
            return
        if prompt_tokens == 0 and 4 * rows >= 3 * c.max_running:
            self.costs = replace(c, step_s=self._mix(c.step_s, seconds))
        elif prompt_tokens >= MIN_PREFILL_TOKENS:
            self.costs = replace(c, prefill_tokens_per_s=self._mix(c.prefill_tokens_per_s,
                                                                   prompt_tokens / seconds))

    def calibrate(self, runner: ModelRunner, *, context: int, prefill_tokens: int,
                  repeats: tuple[int, int] = (8, 3)) -> ServiceCosts:
        """Time a decode step of a full batch at `context` tokens and a prefill step of
        `prefill_tokens` on `runner`, the median of `repeats` (decode, prefill) after one
        untimed call each, and start the estimates from them.  Writes KV blocks 1.. with
        garbage: call it before the engine serves (no block holds anything yet).  Its rows'
        token cells (owners `calibrate-{i}`) are given back afterwards."""
        bs, rows = runner.block_size, self.costs.max_running
        most = min(runner.num_blocks - 1, runner.buckets.table_widths[-1]) * bs
        context = max(1, min(context, most - 1))
        prefill_tokens = max(MIN_PREFILL_TOKENS,
                             min(prefill_tokens, most, runner.buckets.max_tokens))
        table = list(range(1, math.ceil((context + 1) / bs) + 1))
        decode = [runner.row(f"calibrate-{i}", [0], context, table) for i in range(rows)]
        prefill = [runner.row("calibrate-0", [0] * prefill_tokens, 0,
                              list(range(1, math.ceil(prefill_tokens / bs) + 1)))]
        try:
            step_s = _median_time(runner, decode, repeats[0])
            prefill_s = _median_time(runner, prefill, repeats[1])
        finally:
            for row in decode:
                runner.cells.release(row.request_id)
        self.costs = ServiceCosts(rows, step_s, prefill_tokens / prefill_s)
        return self.costs


def _median_time(runner: ModelRunner, rows: list[ScheduledSeq], repeats: int) -> float:
    runner.run(rows).fetch()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.run(rows).fetch()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
