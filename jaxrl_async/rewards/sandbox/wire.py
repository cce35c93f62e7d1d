"""What crosses the sandbox's boundary: the codec of plain data, the job the grader gives the harness
and the report the harness gives back. Stdlib only: it also runs inside the sandbox, beside harness.py.
"""

from __future__ import annotations

import os

PROGRAM = "main.py"  # the candidate's file in the sandbox's working dir
_MAX_DEPTH = 100  # nesting of a value; deeper is an error (also catches self-containing lists)
_INT_JSON = 1 << 63  # ints beyond this travel as hex (json caps decimal digits)
# Without a private network namespace, an audit hook refuses sockets (a weaker guard: ctypes gets past it).
SOCKET_GUARD = (
    "import sys\n"
    "def _guard(event, args):\n"
    "    if event in ('socket.connect', 'socket.bind', 'socket.sendto', 'socket.sendmsg'):\n"
    "        raise PermissionError('network access is disabled in the sandbox')\n"
    "sys.addaudithook(_guard)\n"
    "del _guard\n"
)


# ---- codec: plain data <-> JSON-able trees ----------------------------------------------------------------

# A subclass of a builtin is copied as the builtin through the builtin's own (C) methods, so none of the
# subclass's code runs: an `int` subclass whose __eq__ always returns True arrives as its plain int value.
_COPY_BASE = (
    (int, int.__int__),
    (float, float.__float__),
    (complex, complex.__complex__),
    (str, str.__str__),
    (bytes, bytes.__bytes__),
    (list, lambda x: list(list.__iter__(x))),
    (tuple, lambda x: tuple(tuple.__iter__(x))),
    (dict, lambda x: dict(dict.items(x))),
    (set, lambda x: set(set.__iter__(x))),
    (frozenset, lambda x: frozenset(frozenset.__iter__(x))),
)
_SEQ_TAGS = {list: "l", tuple: "t", set: "s", frozenset: "f"}
_TAG_SEQ = {v: k for k, v in _SEQ_TAGS.items()}


def encode(x, handle=None, _depth=0):
    """A JSON-able tree for plain data; `handle(obj)` encodes anything else (None: TypeError)."""
    t = type(x)
    if x is None or t is bool or t is str or t is float:
        return x
    if t is int:
        return x if -_INT_JSON < x < _INT_JSON else ["i", hex(x)]
    if _depth > _MAX_DEPTH:
        raise ValueError(f"value nested deeper than {_MAX_DEPTH}")
    if t in _SEQ_TAGS:
        return [_SEQ_TAGS[t], [encode(v, handle, _depth + 1) for v in x]]
    if t is dict:
        return ["d", [[encode(k, handle, _depth + 1), encode(v, handle, _depth + 1)] for k, v in x.items()]]
    if t is bytes:
        return ["y", x.hex()]
    if t is complex:
        return ["j", x.real, x.imag]
    for base, copy in _COPY_BASE:
        if issubclass(t, base):
            return encode(copy(x), handle, _depth)
    if handle is None:
        raise TypeError(f"a {t.__qualname__} object is not plain data")
    return handle(x)


def decode(tree, handle=None, _depth=0):
    """The value of an `encode` tree; `handle(tree)` decodes handles (None: ValueError)."""
    t = type(tree)
    if tree is None or t is bool or t is str or t is float or t is int:
        return tree
    if t is not list or not tree or type(tree[0]) is not str or _depth > _MAX_DEPTH + 1:
        raise ValueError("malformed value")
    tag, args = tree[0], tree[1:]
    if tag in _TAG_SEQ and len(args) == 1 and type(args[0]) is list:
        return _TAG_SEQ[tag](decode(v, handle, _depth + 1) for v in args[0])
    if tag == "d" and len(args) == 1 and type(args[0]) is list:
        out = {}
        for pair in args[0]:
            if type(pair) is not list or len(pair) != 2:
                raise ValueError("malformed dict item")
            out[decode(pair[0], handle, _depth + 1)] = decode(pair[1], handle, _depth + 1)
        return out
    if tag == "i" and len(args) == 1 and type(args[0]) is str:
        return int(args[0], 16)
    if tag == "y" and len(args) == 1 and type(args[0]) is str:
        return bytes.fromhex(args[0])
    if tag == "j" and len(args) == 2 and all(type(a) in (int, float) for a in args):
        return complex(float(args[0]), float(args[1]))
    if tag == "h" and handle is not None:
        return handle(tree)
    raise ValueError(f"malformed value (tag {tag!r})")


# JSON through the C accelerator `_json` that the json package wraps: importing json also imports re,
# which costs every sandboxed run several milliseconds of start-up.
_CONSTANTS = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


class _ScanOptions:
    strict = True
    object_hook = object_pairs_hook = None
    parse_float, parse_int, parse_constant = float, int, _CONSTANTS.__getitem__


def _no_default(obj):
    raise TypeError(f"cannot serialise {type(obj).__name__}")


try:
    import _json

    _scan = _json.make_scanner(_ScanOptions)
    _encode = _json.make_encoder(None, _no_default, _json.encode_basestring_ascii, None, ":", ",", False,
                                 False, True)
except (ImportError, AttributeError, TypeError):  # another Python implementation
    import json

    _scan = lambda text, i: json.JSONDecoder().raw_decode(text, i)
    _encode = lambda obj, _: [json.dumps(obj, separators=(",", ":"))]


def loads(data: bytes):
    """One JSON value (ValueError on anything else, trailing garbage included)."""
    text = data.decode().strip()
    try:
        obj, end = _scan(text, 0)
    except (StopIteration, SystemError) as e:
        # _json reports most errors through json.decoder's exception class; until json.decoder is
        # imported it raises nothing, which surfaces as SystemError.
        raise ValueError("malformed JSON") from e
    if end != len(text):
        raise ValueError("trailing data after JSON")
    return obj


def dumps(obj) -> bytes:
    return "".join(_encode(obj, 0)).encode() + b"\n"


# ---- the grader's side: the job and the report ------------------------------------------------------------


def make_job(job: dict) -> tuple[bytes, str]:
    """The job file's bytes with a fresh nonce added, and the nonce."""
    nonce = os.urandom(16).hex()  # the kernel's CSPRNG, as secrets.token_hex (whose import is slow)
    return dumps({**job, "nonce": nonce}), nonce


def read_report(data: bytes, nonce: str) -> list[list]:
    """The report's records that carry `nonce` (without it); malformed or foreign lines are dropped."""
    records = []
    for line in data.split(b"\n"):
        try:
            rec = loads(line)
        except (ValueError, RecursionError):
            continue
        if type(rec) is list and len(rec) >= 2 and rec[0] == nonce and type(rec[1]) is str:
            records.append(rec[1:])
    return records
