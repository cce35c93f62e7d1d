"""Tools: plain Python callables registered by name, and the two built-ins.

A tool takes the call's arguments (`calls.ToolCall`: one string for the "tags" format) and returns text
(str) or bytes (which must be UTF-8). It reports a failure by raising: `ToolError(kind, message)` for a
failure it classifies itself (e.g. the sandbox's time-out), anything else counts as "raised". The
executor (`executor.py`) bounds what comes back; a tool never needs to.

Built-ins:
  - "calculator": arithmetic on numbers (+ - * / // % **, unary +/-, parentheses) by walking the `ast`
    of the expression; no `eval`, no names, no calls, and bounded sizes (a `9**9**9` is refused, not
    computed).
  - "python": runs a program in the code sandbox (`jaxrl_async.rewards.sandbox`: the same rlimits, uid,
    namespaces and read-only file system as the code reward) and answers with its standard output.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable

from jaxrl_async.rewards.sandbox import SandboxLimits, run_python

ToolFn = Callable[..., "str | bytes"]
_REGISTRY: dict[str, ToolFn] = {}


class ToolError(Exception):
    """A failure a tool classifies itself: `kind` is what the run counts ("timeout", "flood", ...)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def register_tool(name: str) -> Callable[[ToolFn], ToolFn]:
    """Decorator: registers `fn` as the tool `name` (a name the tool-call formats accept)."""
    if not name or not (name.replace(".", "_").replace("-", "_")).isidentifier():
        raise ValueError(f"register_tool: invalid tool name {name!r}")

    def deco(fn: ToolFn) -> ToolFn:
        old = _REGISTRY.get(name)
        if old is not None and old is not fn:
            raise ValueError(f"register_tool: {name!r} is already registered to {old!r}")
        _REGISTRY[name] = fn
        return fn

    return deco


def get_tool(name: str) -> ToolFn:
    """The tool registered as `name`.

    Raises:
      KeyError: unknown name (the message lists the known ones).
    """
    if name not in _REGISTRY:
        raise KeyError(f"unknown tool {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def registered_tools() -> list[str]:
    return sorted(_REGISTRY)


# ----- calculator -----

MAX_EXPRESSION_CHARS = 256
MAX_INT_BITS = 4096  # results and operands beyond this are refused (a product of two such is fast)
MAX_EXPONENT = 256
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _check_size(x):
    if isinstance(x, int) and x.bit_length() > MAX_INT_BITS:
        raise ToolError("raised", f"calculator: a number exceeds {MAX_INT_BITS} bits")
    return x


def _evaluate(node):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check_size(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError("raised", f"calculator: exponents are limited to {MAX_EXPONENT}")
        try:
            return _check_size(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolError("raised", "calculator: division by zero") from None
        except OverflowError:
            raise ToolError("raised", "calculator: overflow") from None
    raise ToolError(
        "raised", f"calculator: {type(node).__name__} is not allowed (numbers and + - * / // % ** only)"
    )


@register_tool("calculator")
def calculator(expression: str) -> str:
    """The value of an arithmetic expression: integers stay exact, floats print with 12 significant digits."""
    if not isinstance(expression, str):
        raise ToolError("raised", "calculator: the expression must be a string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError("raised", f"calculator: expressions are limited to {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError("raised", "calculator: not an arithmetic expression") from None
    value = _evaluate(tree)
    if isinstance(value, complex):  # a negative number to a fractional power
        raise ToolError("raised", "calculator: complex result")
    return str(value) if isinstance(value, int) else format(value, ".12g")


# ----- python in the sandbox -----

# Sandbox statuses (SandboxResult.status) that are the tool's failure, and how they count.
_SANDBOX_KINDS = {"timeout": "timeout", "cpu_limit": "timeout", "output_limit": "flood"}


def make_python_tool(limits: SandboxLimits) -> ToolFn:
    """A tool that runs its argument as a Python program in the code sandbox under `limits`."""

    def python(code: str) -> str:
        if not isinstance(code, str):
            raise ToolError("raised", "python: the program must be a string")
        res = run_python(code, limits=limits)
        if res.ok:
            return res.stdout
        kind = _SANDBOX_KINDS.get(res.status, "raised")
        last = (res.stderr.strip().splitlines() or [res.status])[-1]
        raise ToolError(kind, f"python: {res.status}: {last[-200:]}")

    return python


# The sandbox kills a run after 3 s (wall and CPU) and caps its output at 64 KiB: below the default
# tool time-out (EnvConfig.tool_timeout_s = 5), so the sandbox's own classification wins.
register_tool("python")(make_python_tool(SandboxLimits(timeout_s=3.0, cpu_s=3, max_output_bytes=64 << 10)))
