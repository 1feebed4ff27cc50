"""Reasoning models' `<think>...</think>` (Qwen3, QwQ, DeepSeek-R1 distills) split off the answer:
vLLM's `reasoning_content`, in the message and streamed as `delta.reasoning_content`.

A model reasons when its chat template knows the tags (it writes or strips `</think>`).  The
output reasons from an opening `<think>`, or from its first token when the prompt itself ended
in `<think>` (templates that open the block for the model); `</think>` ends the reasoning and the
newlines after it go with the tag.  An output that opens no block is all content (Qwen3 with
`enable_thinking: false`, whose prompt holds an empty block); a block that never closes (the
length limit hit mid-thought) is all reasoning, streamed or not.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"


def template_reasons(chat_template: str | None) -> bool:
    return bool(chat_template) and CLOSE in chat_template


@dataclass
class ReasoningParser:
    """The text of one choice, fed as it streams -> (reasoning, content) pieces.  Text that may
    still be part of a tag is held back, so that any split of the text into pieces gives the
    same two strings."""

    in_reasoning: bool = False    # the prompt opened the block
    _held: str = ""
    _state: str = "start"         # start | reasoning | content
    _after_close: bool = False    # newlines right after </think> are not content

    def __post_init__(self) -> None:
        if self.in_reasoning:
            self._state = "reasoning"

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning = content = ""
        if self._state == "start":
            head = self._held.lstrip()
            if OPEN.startswith(head):
                return "", ""                  # maybe the opening tag: wait
            if head.startswith(OPEN):
                self._held, self._state = head[len(OPEN):], "reasoning"
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = self._held.find(CLOSE)
            if end < 0:
                cut = len(self._held) - _prefix_len(self._held, CLOSE)
                reasoning, self._held = self._held[:cut], self._held[cut:]
                return reasoning, ""
            reasoning, self._held = self._held[:end], self._held[end + len(CLOSE):]
            self._state, self._after_close = "content", True
        if self._after_close:
            self._held = self._held.lstrip("\n")
            if not self._held:
                return reasoning, ""
            self._after_close = False
        content, self._held = self._held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """At the end: what was held back, as reasoning (inside the block) or content."""
        rest, self._held = self._held, ""
        return (rest, "") if self._state == "reasoning" else ("", rest)


def prompt_opens_reasoning(prompt_tail: str) -> bool:
    """Did the rendered prompt end inside a reasoning block (a template that opens it)?"""
    return prompt_tail.rstrip().endswith(OPEN)


def _prefix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
