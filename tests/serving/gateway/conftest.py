"""The gateway tests' fixtures: the SmolLM2 tokenizer and live servers over fake engines
(tests/serving/live_server.py)."""

from tests.serving.live_server import make_server, tokenizer  # noqa: F401 (fixtures)
