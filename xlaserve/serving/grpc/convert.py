"""Engine messages <-> protobuf messages (both directions, used by server and client)."""

from __future__ import annotations

from collections.abc import MutableSequence
from dataclasses import asdict, fields
from typing import Any

from xlaserve.serving.engine_api import EngineStats, ServiceCosts
from xlaserve.serving.grpc import xlaserve_pb2 as pb
from xlaserve.serving.structured.constraint import Constraint
from xlaserve.serving.types import (
    EngineEvent,
    GenerationRequest,
    KVHandoff,
    SamplingParams,
    Tier,
    TokenLogprob,
    Usage,
)


def _fields_from(cls: type, m: Any) -> dict[str, Any]:
    """The fields of the dataclass `cls`, read from the message `m` that names them the same
    (a repeated field as a tuple)."""
    values = {f.name: getattr(m, f.name) for f in fields(cls)}
    return {k: tuple(v) if isinstance(v, MutableSequence) else v for k, v in values.items()}


def sampling_to_pb(s: SamplingParams) -> pb.SamplingParams:
    m = pb.SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                          top_k=s.top_k, min_p=s.min_p, presence_penalty=s.presence_penalty,
                          frequency_penalty=s.frequency_penalty, stop=list(s.stop),
                          stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos)
    if s.seed is not None:
        m.seed = s.seed
    if s.logprobs is not None:
        m.logprobs = s.logprobs
    if s.constraint is not None:
        m.constraint_kind, m.constraint_spec = s.constraint.kind, s.constraint.spec
    return m


def sampling_from_pb(m: pb.SamplingParams) -> SamplingParams:
    """Raises ValueError (naming the field) for out-of-range values.  top_p 0 means unset."""
    return SamplingParams(
        max_tokens=m.max_tokens, temperature=round(m.temperature, 6),
        top_p=round(m.top_p, 6) if m.top_p else 1.0, top_k=m.top_k, min_p=round(m.min_p, 6),
        presence_penalty=round(m.presence_penalty, 6),
        frequency_penalty=round(m.frequency_penalty, 6),
        seed=m.seed if m.HasField("seed") else None, stop=tuple(m.stop),
        stop_token_ids=tuple(m.stop_token_ids), ignore_eos=m.ignore_eos,
        logprobs=m.logprobs if m.HasField("logprobs") else None,
        constraint=Constraint(m.constraint_kind, m.constraint_spec) if m.constraint_kind
        else None)


def request_to_pb(r: GenerationRequest, model: str) -> pb.GenerateRequest:
    m = pb.GenerateRequest(model=model, request_id=r.request_id,
                           prompt_token_ids=r.prompt_token_ids,
                           sampling=sampling_to_pb(r.sampling), tier=int(r.tier),
                           priority=r.priority, tenant=r.tenant, continues=r.continues,
                           output_token_ids=list(r.output_token_ids))
    if not r.speculative:
        m.speculative = False
    return m


def speculative_from_pb(m: pb.GenerateRequest) -> bool:
    """The request's opt-out: absent means it may speculate."""
    return m.speculative if m.HasField("speculative") else True


def event_to_pb(e: EngineEvent) -> pb.GenerateResponse:
    m = pb.GenerateResponse(request_id=e.request_id, token_ids=list(e.token_ids), text=e.text,
                            finish_reason=e.finish_reason or "", error=e.error or "")
    for lp in e.logprobs:
        m.logprobs.append(pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                                          top_token_ids=[t for t, _ in lp.top],
                                          top_logprobs=[v for _, v in lp.top]))
    if e.usage is not None:
        m.usage.CopyFrom(pb.Usage(**asdict(e.usage)))
    if e.kv_handoff is not None:
        h = e.kv_handoff
        m.kv_blocks, m.kv_bytes, m.kv_seconds = h.blocks, h.nbytes, h.seconds
    return m


def event_from_pb(m: pb.GenerateResponse) -> EngineEvent:
    return EngineEvent(
        request_id=m.request_id, token_ids=tuple(m.token_ids), text=m.text,
        logprobs=tuple(TokenLogprob(lp.token_id, lp.logprob,
                                    tuple(zip(lp.top_token_ids, lp.top_logprobs)))
                       for lp in m.logprobs),
        finish_reason=m.finish_reason or None,
        usage=Usage(**_fields_from(Usage, m.usage)) if m.HasField("usage") else None,
        error=m.error or None,
        kv_handoff=KVHandoff(m.kv_blocks, m.kv_bytes, m.kv_seconds) if m.kv_seconds else None)


def tier_from_pb(v: int) -> Tier:
    try:
        return Tier(v)
    except ValueError:
        raise ValueError(f"tier={v}: must be one of {[int(t) for t in Tier]}") from None


def stats_to_pb(s: EngineStats, costs: ServiceCosts, ready: bool) -> pb.EngineStats:
    return pb.EngineStats(**asdict(s), **asdict(costs), ready=ready)


def stats_from_pb(m: pb.EngineStats) -> EngineStats:
    return EngineStats(**_fields_from(EngineStats, m))


def costs_from_pb(m: pb.EngineStats) -> ServiceCosts:
    return ServiceCosts(**_fields_from(ServiceCosts, m))
