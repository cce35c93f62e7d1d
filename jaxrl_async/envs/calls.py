"""Tool-call formats: how a model turn calls a tool, and how the tool's answer is written back.

A format parses a turn's text into a `ToolCall`, a `Malformed` call (the turn tried to call a tool and
got the syntax wrong: the episode answers it with an error observation, it never raises) or None (no
call: the turn is the final answer). Only the turn's first call counts; text after it is ignored.

  - "tags": `<tool name=calc>12*34</tool>`; the name may be quoted; the body is the tool's one argument.
  - "json": `<tool>{"name": "calc", "arguments": "12*34"}</tool>`; `arguments` is a string (the one
    argument), an object (keyword arguments) or absent (no argument).

Both answer with `<result>TEXT</result>`. A tool's output must not be able to close its result early or
forge a call the model never made, so `neutralize` strips the format's markers from it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any

_NAME = r"[A-Za-z_][\w.\-]*"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A parsed call: `name(*args, **kwargs)`."""

    name: str
    args: tuple = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Malformed:
    """A turn that opened a tool call the format cannot read; `reason` goes into the error observation."""

    reason: str


class _Format:
    """What both formats share: the result markers and `neutralize`."""

    name = ""
    open_marker = "<tool"
    close_marker = "</tool>"
    result_open = "<result>"
    result_close = "</result>"

    @property
    def markers(self) -> tuple[str, ...]:
        return (self.open_marker, self.close_marker, self.result_open, self.result_close)

    def neutralize(self, text: str) -> tuple[str, bool]:
        """(`text` with every marker's "<" removed, whether there was any): tool output can then neither
        end its result block nor look like a call."""
        out = text
        for marker in self.markers:
            out = out.replace(marker, marker[1:])
        return out, out != text

    def _call_span(self, text: str) -> tuple[int, int] | Malformed | None:
        """(start, end) of the first call's opening and closing markers, or why it is malformed."""
        start = text.find(self.open_marker)
        if start < 0:
            return None
        end = text.find(self.close_marker, start)
        if end < 0:
            return Malformed(
                f"a tool call opened with {self.open_marker!r} needs a closing {self.close_marker!r}"
            )
        return start, end

    def parse(self, text: str) -> ToolCall | Malformed | None:
        raise NotImplementedError


class TagFormat(_Format):
    """`<tool name=NAME>ARGUMENT</tool>`."""

    name = "tags"
    _HEAD = re.compile(rf"<tool\s+name\s*=\s*(\"?)({_NAME})\1\s*>")

    def parse(self, text: str) -> ToolCall | Malformed | None:
        span = self._call_span(text)
        if not isinstance(span, tuple):
            return span
        start, end = span
        head = self._HEAD.match(text, start, end)
        if head is None:
            return Malformed("expected <tool name=NAME>ARGUMENT</tool>")
        return ToolCall(head.group(2), (text[head.end() : end],))


class JsonFormat(_Format):
    """`<tool>{"name": NAME, "arguments": STRING | OBJECT}</tool>`."""

    name = "json"

    def parse(self, text: str) -> ToolCall | Malformed | None:
        span = self._call_span(text)
        if not isinstance(span, tuple):
            return span
        start, end = span
        head = text.find(">", start, end)
        if head < 0 or text[start:head].strip() != self.open_marker:
            return Malformed('expected <tool>{"name": ..., "arguments": ...}</tool>')
        try:
            call = json.loads(text[head + 1 : end])
        except (ValueError, RecursionError) as e:
            return Malformed(f"the call is not valid JSON ({type(e).__name__})")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return Malformed('the call must be a JSON object with a string "name"')
        if not re.fullmatch(_NAME, call["name"]):
            return Malformed(f"invalid tool name {call['name'][:40]!r}")
        arguments = call.get("arguments", None)
        if arguments is None:
            return ToolCall(call["name"])
        if isinstance(arguments, str):
            return ToolCall(call["name"], (arguments,))
        if isinstance(arguments, dict) and all(isinstance(k, str) and k.isidentifier() for k in arguments):
            return ToolCall(call["name"], (), dict(arguments))
        return Malformed('"arguments" must be a string or an object of named arguments')


FORMATS = {"tags": TagFormat, "json": JsonFormat}


def get_format(name: str) -> _Format:
    """The format called `name` (EnvConfig.tool_format)."""
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}; known: {sorted(FORMATS)}")
    return FORMATS[name]()
