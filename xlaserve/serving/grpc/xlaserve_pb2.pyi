from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "constraint_kind", "constraint_spec")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_KIND_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_SPEC_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    constraint_kind: str
    constraint_spec: str
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., constraint_kind: _Optional[str] = ..., constraint_spec: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "request_id", "prompt_token_ids", "prompt", "sampling", "tier", "priority", "tenant", "speculative", "continues", "output_token_ids", "kv_source")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    CONTINUES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    model: str
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt: str
    sampling: SamplingParams
    tier: int
    priority: int
    tenant: str
    speculative: bool
    continues: bool
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_source: str
    def __init__(self, model: _Optional[str] = ..., request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., tier: _Optional[int] = ..., priority: _Optional[int] = ..., tenant: _Optional[str] = ..., speculative: _Optional[bool] = ..., continues: _Optional[bool] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., kv_source: _Optional[str] = ...) -> None: ...

class ExportKVRequest(_message.Message):
    __slots__ = ("model", "prompt_token_ids", "tenant", "first_block", "follow_request_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tenant: str
    first_block: int
    follow_request_id: str
    def __init__(self, model: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., tenant: _Optional[str] = ..., first_block: _Optional[int] = ..., follow_request_id: _Optional[str] = ...) -> None: ...

class PrefetchKVRequest(_message.Message):
    __slots__ = ("model", "prompt_token_ids", "tenant", "kv_source", "request_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tenant: str
    kv_source: str
    request_id: str
    def __init__(self, model: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., tenant: _Optional[str] = ..., kv_source: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class PrefetchKVResponse(_message.Message):
    __slots__ = ("kv_blocks", "kv_bytes", "kv_seconds", "complete")
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    kv_blocks: int
    kv_bytes: int
    kv_seconds: float
    complete: bool
    def __init__(self, kv_blocks: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., kv_seconds: _Optional[float] = ..., complete: _Optional[bool] = ...) -> None: ...

class KVBlocks(_message.Message):
    __slots__ = ("block_size", "first_block", "shape", "dtype", "k", "v")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    first_block: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    k: bytes
    v: bytes
    def __init__(self, block_size: _Optional[int] = ..., first_block: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., k: _Optional[bytes] = ..., v: _Optional[bytes] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "num_draft_tokens", "num_accepted_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "finish_reason", "usage", "error", "kv_blocks", "kv_bytes", "kv_seconds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_SECONDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: str
    usage: Usage
    error: str
    kv_blocks: int
    kv_bytes: int
    kv_seconds: float
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., error: _Optional[str] = ..., kv_blocks: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., kv_seconds: _Optional[float] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "max_model_len", "ready")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    name: str
    max_model_len: int
    ready: bool
    def __init__(self, name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., ready: _Optional[bool] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class EngineStats(_message.Message):
    __slots__ = ("num_running", "num_waiting", "kv_blocks_total", "kv_blocks_used", "kv_blocks_cached", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_finished", "ready", "max_running", "step_s", "prefill_tokens_per_s", "spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_acceptance_counts", "kv_fetching", "kv_blocks_prefetched", "kv_blocks_fetched")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTANCE_COUNTS_FIELD_NUMBER: _ClassVar[int]
    KV_FETCHING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_PREFETCHED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FETCHED_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_finished: int
    ready: bool
    max_running: int
    step_s: float
    prefill_tokens_per_s: float
    spec_num_drafts: int
    spec_num_draft_tokens: int
    spec_num_accepted_tokens: int
    spec_acceptance_counts: _containers.RepeatedScalarFieldContainer[int]
    kv_fetching: int
    kv_blocks_prefetched: int
    kv_blocks_fetched: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_cached: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_finished: _Optional[int] = ..., ready: _Optional[bool] = ..., max_running: _Optional[int] = ..., step_s: _Optional[float] = ..., prefill_tokens_per_s: _Optional[float] = ..., spec_num_drafts: _Optional[int] = ..., spec_num_draft_tokens: _Optional[int] = ..., spec_num_accepted_tokens: _Optional[int] = ..., spec_acceptance_counts: _Optional[_Iterable[int]] = ..., kv_fetching: _Optional[int] = ..., kv_blocks_prefetched: _Optional[int] = ..., kv_blocks_fetched: _Optional[int] = ...) -> None: ...
