"""The engine: continuous batching over the paged KV cache (see engine.py for the step)."""

from xlaserve.serving.engine.config import EngineConfig
from xlaserve.serving.engine.engine import LLMEngine

__all__ = ["EngineConfig", "LLMEngine"]
