"""The engine: scheduler + runner + per-request output state, one `step()` at a time.

    add(request) ──> scheduler queue
    step():  plan = scheduler.schedule()          host: which rows run, with which blocks
             call = runner.run(plan rows)         device: one call for every row (decodes and
                                                  prefill chunks), launched, not awaited
             process the previous step's calls    host: fetch tokens (the device is busy with
                                                  this step meanwhile), detokenize, stop checks,
                                                  events, finish
    abort(id) ──> frees its blocks at once

With `pipelined`, step n+1 is scheduled and launched before step n's tokens are read back:
rows whose input is the token sampled in step n carry a placeholder the runner fills on device.
Requests with presence/frequency penalties need their last token on the host, so a step that has
any is processed before the next is scheduled; so do requests that speculate, unless their step
was full (the proposal continues their last token; a full step leaves no room for drafts).
A verify row brings up to k + 1 tokens at once: they go out as one event, cut at the first
that ends the request (stop token or string, max_tokens).  Constrained requests (structured
outputs) need their last token too, for their next allowed-token mask, but only for the
sampler: a step with constrained rows is scheduled and its forward launched as usual, and the
step before it is processed (tokens read, grammars advanced, masks made) while that forward
runs; only its sampler waits.  (Constrained requests do not speculate: a draft position's mask
would need the grammar advanced by drafts not yet accepted.)

    pipelined, constrained rows in step n+1:
      host    schedule n+1 | launch fwd n+1 | process n, masks n+1 | launch sample n+1 | ...
      device  ... sample n | fwd n+1 ................................| sample n+1 | fwd n+2
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np

from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import Params
from xlaserve.serving.engine.config import EngineConfig
from xlaserve.serving.engine.draft_model import make_draft_runner
from xlaserve.serving.engine.draft_proposer import DraftProposer
from xlaserve.serving.engine.output_state import OutputState
from xlaserve.serving.engine.service_costs import CostMeter
from xlaserve.serving.engine.step_clock import HostTime, StepClock
from xlaserve.serving.runner.draft_runner import DraftRunner
from xlaserve.serving.runner.calls import CallResult
from xlaserve.serving.runner.runner import ModelRunner
from xlaserve.serving.runner.token_mask import all_allowed
from xlaserve.serving.scheduler import RequestState, Scheduler
from xlaserve.serving.scheduler.step_plan import StepPlan
from xlaserve.serving.structured.grammar import GrammarCompiler
from xlaserve.serving.tokenizer import Tokenizer
from xlaserve.serving.types import EngineEvent, GenerationRequest, TokenLogprob, Usage

log = logging.getLogger(__name__)


@dataclass
class _Launched:
    plan: StepPlan
    call: CallResult | None = None   # None until launched (a failed launch leaves it None)
    launched_at: float = 0.0         # time.monotonic() of the launch


class LLMEngine:
    def __init__(self, params: Params, config: ModelConfig, tokenizer: Tokenizer, mesh,
                 engine_config: EngineConfig = EngineConfig(), *,
                 runner: ModelRunner | None = None, draft_runner: DraftRunner | None = None):
        """`runner` shares an existing runner (and its compiled buckets); the scheduler may
        then use fewer KV blocks than the runner holds, e.g. to force preemption in a test.
        `draft_runner` likewise for speculative method "draft" (else built, not warmed up)."""
        config = config.for_context(engine_config.scheduler.max_model_len)
        self.model_config = config
        self.config = engine_config
        self.tokenizer = tokenizer
        spec = engine_config.speculative
        self.draft: DraftProposer | None = None
        if spec is not None and spec.method == "draft":
            self.draft = DraftProposer(
                draft_runner or make_draft_runner(params, config, mesh, engine_config),
                spec.num_speculative_tokens)
        self.scheduler = Scheduler(engine_config.scheduler, spec, self.draft)
        s = engine_config.scheduler
        if runner is None:
            runner = ModelRunner(params, config, mesh, **engine_config.runner_args())
        elif (runner.num_blocks < s.num_kv_blocks or runner.max_num_seqs < s.max_num_seqs
              or runner.block_size != s.block_size):
            raise ValueError(f"runner (blocks={runner.num_blocks}, seqs={runner.max_num_seqs}, "
                             f"block_size={runner.block_size}) is smaller than {engine_config}")
        self.runner = runner
        self._outputs: dict[str, OutputState] = {}
        runner.cells.release_all()   # one engine drives a runner at a time: this one now
        # the calls of the scheduler's plans in flight (their order: scheduler.in_flight)
        self._calls: dict[int, _Launched] = {}
        self._rng = random.Random(engine_config.seed)
        self._ready: list[EngineEvent] = []   # made, not yet returned by step()
        self.num_steps = 0
        self.host_time = HostTime()
        self.clock = StepClock()
        self.costs = CostMeter(s.max_num_seqs)
        self.grammars = GrammarCompiler(tokenizer, config.vocab_size)

    # -- requests ------------------------------------------------------------------------------

    def add(self, request: GenerationRequest) -> None:
        """Queue a request (ValueError when it can never run: bad ids, too long, ...)."""
        vocab = self.model_config.vocab_size
        bad = [t for t in (*request.prompt_token_ids, *request.output_token_ids)
               if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request.request_id!r}: token ids {bad[:5]} are outside "
                             f"the vocabulary [0, {vocab})")
        constraint = request.sampling.constraint
        grammar = None if constraint is None else self.grammars.start(constraint)  # ValueError
        if not request.arrival_time:   # the caller's request stays as it was
            request = replace(request, arrival_time=time.monotonic())
        if request.sampling.seed is None:   # drawn once: every row of it samples with it
            request = replace(request, sampling=replace(request.sampling,
                                                        seed=self._rng.getrandbits(32)))
        state = OutputState.create(request, self.tokenizer,   # ValueError
                                   self.model_config.eos_token_ids, vocab, grammar)
        self.scheduler.add(request)
        self._outputs[request.request_id] = state

    def abort(self, request_id: str) -> bool:
        """End a request in any phase and free its blocks; False if it is unknown/finished."""
        if request_id not in self._outputs:
            return False
        state = self.scheduler.abort(request_id)
        self._ready.append(self._final(request_id, "abort", state))
        return True

    def warmup(self) -> None:
        """Compile every bucket of the runner (and of the draft model's runner)."""
        self.runner.warmup()
        if self.draft is not None:
            self.draft.runner.warmup()

    def calibrate(self) -> None:
        """Measure the step costs admission projects from (before serving: see CostMeter)."""
        s = self.config.scheduler
        costs = self.costs.calibrate(self.runner, context=min(512, s.max_model_len // 4),
                                     prefill_tokens=s.max_prefill_chunk)
        log.info("step costs: %.1f ms per decode step of %d rows, %.0f prompt tokens/s",
                 1e3 * costs.step_s, costs.max_running, costs.prefill_tokens_per_s)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._calls) or bool(self._ready)

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> list[EngineEvent]:
        """One step's events.  When it raises (a device error may surface at launch or only
        when results are read), the events made so far and the plans in flight stay with the
        engine for `fail_in_flight`."""
        if self._calls and (not self.config.pipelined or self._needs_host_tokens()):
            self._process_oldest()
        t0 = time.perf_counter()
        plan = self.scheduler.schedule(time.monotonic())
        for rid in plan.preempted:  # recomputed from known tokens: its slot is not needed
            self.runner.cells.release(rid)
        t1 = time.perf_counter()
        self.host_time.schedule += t1 - t0
        if not plan.is_empty:
            launched = _Launched(plan, launched_at=time.monotonic())
            self._calls[plan.step_id] = launched  # before launching: a failure must see it
            self._launch(launched)
            self.num_steps += 1
            self.host_time.steps += 1
            nested, self.host_time.nested = self.host_time.nested, 0.0
            self.host_time.launch += time.perf_counter() - t1 - nested
        keep = 1 if (self.config.pipelined and not plan.is_empty) else 0
        while len(self._calls) > keep:
            self._process_oldest()
        events, self._ready = self._ready, []
        return events

    def next_launch_at(self, lead_s: float, min_step_s: float = 0.0) -> float | None:
        """When to schedule the next step so that it is launched `lead_s` before the step in
        flight ends (time.monotonic()), or None to schedule now: nothing in flight, not
        pipelined, a step already done, no timing yet for its bucket, or a step expected to
        take less than `min_step_s`.  Scheduling late lets requests that arrive while the
        device works join the next step instead of the one after it (one step less of time
        to first token); behind a short step that gain is small (an arrival waits one short
        step more) and a launch that comes late idles the device for a large part of it."""
        if not self.config.pipelined or not self._calls:
            return None
        last = self._calls[self.scheduler.in_flight[-1].step_id]
        if last.call is None or last.call.ready():
            return None
        took = self.clock.seconds.get(last.call.bucket)
        if took is None or took < min_step_s:
            return None
        return self.clock.expected_end(last.call.bucket, last.launched_at) - lead_s

    def in_flight_ready(self) -> bool:
        """Has the device finished every step in flight?"""
        return all(x.call is None or x.call.ready() for x in self._calls.values())

    def run_until_done(self) -> Iterator[EngineEvent]:
        while self.has_work():
            yield from self.step()

    def _needs_host_tokens(self) -> bool:
        """Must the steps in flight be read back before the next is scheduled?  For rows with
        penalties, and for speculating rows of a step that verified drafts or had sample rows
        to spare (the next step likely has too, and their drafts continue the token in flight;
        a full step keeps the pipeline and its rows decode one token)."""
        rows = self.config.scheduler.max_num_seqs
        for plan in self.scheduler.in_flight:
            spec = self.scheduler.proposer is not None and (
                plan.num_samples < rows or any(r.num_draft for r in plan.rows))
            for r in plan.rows:
                state = self._outputs.get(r.request_id)
                if state is not None and (state.uses_penalties
                                          or (spec and state.request.speculative)):
                    return True
        return False

    def _penalty_biases(self, plan: StepPlan) -> dict[str, np.ndarray]:
        """[V] logit bias of each sampling row with penalties, from its tokens so far."""
        out = {}
        for row in plan.rows:
            bias = self._outputs[row.request_id].penalty_bias() if row.sample else None
            if bias is not None:
                out[row.request_id] = bias
        return out

    def _draft_probs(self, plan: StepPlan) -> dict[str, np.ndarray]:
        """[num_draft, V] for each verify row whose drafts a draft model drew at temperature
        > 0 (the distributions it drew them from); greedy and n-gram drafts have none."""
        if self.draft is None:
            return {}
        out = {}
        for row in plan.rows:
            q = self.draft.probs.pop(row.request_id, None) if row.num_draft else None
            if q is not None:
                out[row.request_id] = q
        return out

    def _launch(self, launched: _Launched) -> None:
        plan = launched.plan
        constrained = any(r.sample and r.request_id in self._outputs
                          and self._outputs[r.request_id].grammar is not None
                          for r in plan.rows)
        forwarded = self.runner.forward(plan.rows, self._penalty_biases(plan),
                                        self._draft_probs(plan))
        launched.call = self.runner.sample(forwarded, self._masks(plan) if constrained else None)

    def _masks(self, plan: StepPlan) -> np.ndarray:   # [rows, ceil(V/32)] int32
        """The allowed-token masks of `plan`'s rows, made once the plan's forward is launched:
        first every earlier step in flight is processed (its tokens advance the grammars), then
        each sampling constrained row gets its grammar's mask; the other rows (and requests
        that ended meanwhile) allow everything."""
        t0 = time.perf_counter()
        while self.scheduler.in_flight[0].step_id != plan.step_id:
            self._process_oldest()
        t1 = time.perf_counter()
        masks = all_allowed(len(plan.rows), self.model_config.vocab_size)
        for i, row in enumerate(plan.rows):
            state = self._outputs.get(row.request_id)
            if row.sample and state is not None and state.grammar is not None:
                state.grammar.fill(masks[i])
        self.host_time.masks += time.perf_counter() - t1
        self.host_time.nested += time.perf_counter() - t0   # not launch time
        return masks

    def _process_oldest(self) -> None:
        """Read back the oldest step in flight; its call is forgotten only once processed."""
        step_id = self.scheduler.in_flight[0].step_id
        self._process(self._calls[step_id])
        del self._calls[step_id]

    def _process(self, launched: _Launched) -> None:
        t0 = t1 = time.perf_counter()
        sampled: dict[str, tuple[int, ...]] = {}
        logprobs: dict[str, tuple[TokenLogprob, ...]] = {}
        if launched.call is not None:
            waited = not launched.call.ready()
            host = launched.call.fetch()
            took = self.clock.fetched(launched.call.bucket, launched.launched_at, waited)
            if took is not None:
                plan = launched.plan
                self.costs.observe(len(plan.rows), sum(r.num_tokens for r in plan.prefills), took)
            t1 = time.perf_counter()
            sampled, logprobs = self._samples(launched, host)
        self.host_time.wait += t1 - t0
        live = self.scheduler.update(launched.plan, sampled)
        events = self._ready   # appended as made: a later failure still returns them
        for rid, tokens in live.items():
            events.append(self._emit(rid, tokens, logprobs.get(rid, ())))
        self.host_time.process += time.perf_counter() - t1

    def _samples(self, launched: _Launched, host: dict
                 ) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[TokenLogprob, ...]]]:
        """Each sampling row's tokens (k + 1 for a verify row) and, where asked, logprobs."""
        assert launched.call is not None
        sampled: dict[str, tuple[int, ...]] = {}
        logprobs: dict[str, tuple[TokenLogprob, ...]] = {}
        for row, where in zip(launched.plan.rows, launched.call.sample_rows):
            if not row.sample:
                continue
            rid = row.request_id
            sampled[rid] = tuple(int(host["tokens"][j]) for j in where)
            k = self._outputs[rid].request.sampling.logprobs if rid in self._outputs else None
            if k is not None:
                logprobs[rid] = tuple(
                    TokenLogprob(int(host["tokens"][j]), float(host["logprob"][j]),
                                 tuple((int(t), float(lp)) for t, lp in
                                       zip(host["top_ids"][j][:k], host["top_logprobs"][j][:k])))
                    for j in where)
        return sampled, logprobs

    def _emit(self, rid: str, tokens: tuple[int, ...],
              logprobs: tuple[TokenLogprob, ...]) -> EngineEvent:
        """One event for the tokens `rid` gained this step, up to the one that ends it (the
        request is then finished and the event carries finish_reason and usage)."""
        state = self._outputs[rid]
        ids: list[int] = []
        text: list[str] = []
        lps: list[TokenLogprob] = []
        reason = None
        for i, token in enumerate(tokens):
            event, reason = state.accept(token, logprobs[i] if logprobs else None)
            ids.extend(event.token_ids)
            text.append(event.text)
            lps.extend(event.logprobs)
            if reason is None and (len(state.output_ids) >= state.request.sampling.max_tokens
                                   or i == len(tokens) - 1):
                reason = self.scheduler.length_finish_reason(rid)
                if reason is not None and not state.request.continues:
                    tail, stopped = state.flush_text()
                    reason = "stop" if stopped else reason   # a stop string matched last
                    text.append(tail)
            if reason is not None:
                break
        if reason is None:
            return EngineEvent(rid, tuple(ids), "".join(text), tuple(lps))
        final = self._final(rid, reason, self.scheduler.finish(rid, reason))
        return EngineEvent(rid, tuple(ids), "".join(text), tuple(lps), final.finish_reason,
                           final.usage)

    def fail_in_flight(self, error: str) -> list[EngineEvent]:
        """`step()` raised, at launch or when reading results back, and the donated KV arrays
        may be gone with it: return the events made before the failure, end every running or
        in-flight request with an error, forget the plans in flight and the prefix cache, and
        go on from a fresh KV cache.  Waiting requests (holding no blocks) are served
        afterwards."""
        victims = set(self.scheduler.kv_cache.request_ids())
        for launched in self._calls.values():
            victims.update(r.request_id for r in launched.plan.rows)
        events, self._ready = self._ready, []
        for rid in sorted(victims):
            if rid in self.scheduler:
                final = self._final(rid, "error", self.scheduler.finish(rid, "error"))
                events.append(EngineEvent(rid, finish_reason="error", usage=final.usage,
                                          error=error))
        self._calls.clear()
        self.scheduler.drop_in_flight()
        self.scheduler.kv_cache.pool.forget_hashes()
        self.runner.reset_state()
        if self.draft is not None:
            self.draft.runner.reset_state()
        return events

    def _final(self, request_id: str, reason: str, state: RequestState | None) -> EngineEvent:
        out = self._outputs.pop(request_id)
        self.runner.cells.release(request_id)
        counts = () if state is None else (state.num_cached_tokens, state.num_draft_tokens,
                                           state.num_accepted_tokens)
        usage = Usage(len(out.request.prompt_token_ids), len(out.output_ids), *counts)
        return EngineEvent(request_id, finish_reason=reason, usage=usage)
