"""The wire format between processes: known message types and plain numpy arrays, never objects.

A message for `endpoint` becomes two byte strings:

  body     JSON of [endpoint, tree]. Scalars (None, bool, int, float, str) are JSON scalars; every container
           is a JSON list whose first item is its tag:
             ["l", item...]                 list
             ["t", item...]                 tuple
             ["d", key, value, ...]         dict (keys: str or int)
             ["a", dtype, [shape...]]       numpy array: its bytes are the next ones in `buffers`
             ["o", type name, field...]     a registered dataclass, its fields in schema order
  buffers  the arrays' bytes, in the order the arrays appear in the body, each padded to 8 bytes.

Decoding builds only Python scalars, lists, tuples, dicts, numpy arrays of the dtypes in `DTYPES`, and
the dataclasses registered here, each checked field by field against its schema (a Hello whose
process_id is a string is malformed, not a crash later). Sizes, nesting depth, the number of values and
array ranks are bounded (`Limits`). Anything else raises `CodecError`. Nothing here can run code named by
the bytes: there is no pickle, no import by name, no object dtype.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

import ml_dtypes
import numpy as np

from jaxrl_async.data.prompt import Prompt
from jaxrl_async.rollouts import Rollout
from jaxrl_async.runtime import messages as m

# The array dtypes that may cross, little-endian (by name: decoding never hands a received string to
# np.dtype).
DTYPES = {
    name: np.dtype(name).newbyteorder("<")
    for name in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                 "float16", "float32", "float64")
}  # fmt: skip
DTYPES["bfloat16"] = np.dtype(ml_dtypes.bfloat16)
_NAMES = {d: name for name, d in DTYPES.items()}
_INT_RANGE = (-(2**63), 2**63)
_ALIGN = 8


class CodecError(ValueError):
    """Bytes that are not a well-formed message of a known type within the limits."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds on what one message may hold (checked before and while decoding).

    Attributes:
      max_bytes: body + array bytes.
      max_depth: nesting of containers.
      max_values: scalars, containers and arrays together (bounds the decoding work of a small body).
      max_ndim: rank of an array.
      max_endpoint: characters of the endpoint name.
    """

    max_bytes: int = 1 << 30
    max_depth: int = 32
    max_values: int = 10_000_000
    max_ndim: int = 8
    max_endpoint: int = 64

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"Limits.{f.name} must be >= 1, got {getattr(self, f.name)}")


# ----- schemas ------------------------------------------------------------------------------------------


class _Spec:
    """What one field may hold: `read` decodes the JSON value `x` (and its array bytes) into it or raises
    CodecError; decoding follows the schema, so a dataclass is built only where a schema names it."""

    def read(self, r: _Reader, x, depth: int, path: str):
        raise NotImplementedError


class _Scalar(_Spec):
    def __init__(self, *types: type, name: str):
        self.types, self.name = types, name

    def read(self, r, x, depth, path):
        r.count()
        if type(x) not in self.types:
            raise CodecError(f"{path}: expected {self.name}, got {type(x).__name__}")
        if type(x) is int and not _INT_RANGE[0] <= x < _INT_RANGE[1]:
            raise CodecError(f"{path}: integer out of the int64 range")
        return float(x) if self.name == "float" else x


class _Optional(_Spec):
    def __init__(self, inner: _Spec):
        self.inner = inner

    def read(self, r, x, depth, path):
        return None if x is None else self.inner.read(r, x, depth, path)


class _Seq(_Spec):
    def __init__(self, tag: str, item: _Spec):
        self.tag, self.item = tag, item

    def read(self, r, x, depth, path):
        rest = r.container(x, self.tag, depth, path)
        return [self.item.read(r, v, depth + 1, path) for v in rest]


class _Tuple(_Spec):
    def __init__(self, *items: _Spec):
        self.items = items

    def read(self, r, x, depth, path):
        rest = r.container(x, "t", depth, path)
        if len(rest) != len(self.items):
            raise CodecError(f"{path}: expected a tuple of {len(self.items)}")
        return tuple(s.read(r, v, depth + 1, path) for s, v in zip(self.items, rest, strict=True))


class _Array(_Spec):
    def __init__(self, kinds: str, ndim: int):
        self.kinds, self.ndim = kinds, ndim

    def read(self, r, x, depth, path):
        a = r.array(r.container(x, "a", depth, path), path)
        if a.dtype.kind not in self.kinds or a.ndim != self.ndim:
            raise CodecError(f"{path}: expected a rank-{self.ndim} array of kind {self.kinds!r}")
        return a


class _Plain(_Spec):
    """Plain data: scalars, lists, tuples, dicts (str or int keys) and arrays of them; no dataclass."""

    def __init__(self, only_dict: bool = False):
        self.only_dict = only_dict

    def read(self, r, x, depth, path):
        if self.only_dict and not (type(x) is list and x and x[0] == "d"):
            raise CodecError(f"{path}: expected a dict")
        if x is None or type(x) in (bool, int, float, str):
            return _ANY_SCALAR.read(r, x, depth, path)
        rest = r.container(x, None, depth, path)
        tag = x[0]
        if tag in ("l", "t"):
            items = [self.read_any(r, v, depth + 1, path) for v in rest]
            return items if tag == "l" else tuple(items)
        if tag == "d":
            if len(rest) % 2:
                raise CodecError(f"{path}: a dict with an odd number of items")
            out = {}
            for k, v in zip(rest[::2], rest[1::2], strict=True):
                if type(k) not in (str, int):
                    raise CodecError(f"{path}: a dict key that is neither str nor int")
                out[k] = self.read_any(r, v, depth + 1, path)
            return out
        if tag == "a":
            return r.array(rest, path)
        raise CodecError(f"{path}: tag {str(tag)[:16]!r} where plain data is expected")

    def read_any(self, r, x, depth, path):
        return PLAIN.read(r, x, depth, path)


class _Object(_Spec):
    def __init__(self, cls: type):
        self.cls = cls

    def read(self, r, x, depth, path):
        rest = r.container(x, "o", depth, path)
        name = self.cls.__name__
        if not rest or rest[0] != name:
            raise CodecError(f"{path}: expected a {name}")
        schema = SCHEMAS[self.cls]
        if len(rest) - 1 != len(schema):
            raise CodecError(f"{name}: {len(rest) - 1} fields, expected {len(schema)}")
        fields = {
            f: spec.read(r, v, depth + 1, f"{name}.{f}")
            for (f, spec), v in zip(schema.items(), rest[1:], strict=True)
        }
        return self.cls(**fields)


_ANY_SCALAR = _Scalar(type(None), bool, int, float, str, name="a scalar")
INT = _Scalar(int, name="int")
FLOAT = _Scalar(float, int, name="float")
STR = _Scalar(str, name="str")
BOOL = _Scalar(bool, name="bool")
PLAIN, DICT = _Plain(), _Plain(only_dict=True)
GROUPS = _Seq("l", _Seq("l", _Object(Rollout)))
IDS = _Seq("l", INT)

# Every type that may cross, with a spec for each of its fields (in the order they travel).
SCHEMAS: dict[type, dict[str, _Spec]] = {
    Prompt: {"uid": STR, "text": STR, "tokens": _Array("iu", 1), "answer": STR, "metadata": DICT, "key": STR,
             "weight": FLOAT},
    Rollout: {"uid": STR, "group_id": INT, "sample_index": INT, "prompt_tokens": _Array("iu", 1),
              "completion_tokens": _Array("iu", 1), "behav_logprobs": _Array("f", 1),
              "versions": _Array("iu", 1), "reward": FLOAT, "finish_reason": STR, "metadata": DICT,
              "model_mask": _Optional(_Array("b", 1))},
    m.Hello: {"process_id": INT},
    m.TicketRequest: {"actor": INT, "n": INT},
    m.Tickets: {"prompts": _Seq("l", _Tuple(INT, _Object(Prompt))), "exhausted": BOOL},
    m.ActorStats: {"version": _Optional(INT), "sample_tokens": INT, "completions": INT, "occupancy": FLOAT,
                   "idle_s": FLOAT, "weight_s": FLOAT, "eval_s": FLOAT,
                   "eval_spans": _Seq("l", _Tuple(INT, FLOAT, FLOAT)), "evals_skipped": IDS,
                   "sample_calls_during_eval": INT, "reward_errors": INT, "drained": BOOL,
                   "checksums": DICT, "reward_stats": _Optional(DICT), "replica": _Optional(DICT),
                   "executables": _Optional(DICT), "wall_s": FLOAT, "env": _Optional(DICT),
                   "weight_bytes": _Optional(DICT)},
    m.Rollouts: {"actor": INT, "groups": GROUPS, "stats": _Object(m.ActorStats)},
    m.NewWeights: {"version": INT, "params": _Scalar(type(None), name="None (weights are pulled)"),
                   "checksum": _Optional(FLOAT)},
    m.EvalResult: {"version": INT, "accuracy": FLOAT, "seconds": FLOAT, "checksum": _Optional(FLOAT),
                   "expected_reward": _Optional(FLOAT), "expected_reward_stderr": _Optional(FLOAT)},
    m.TrainBatch: {"version": INT, "groups": GROUPS},
    m.Trained: {"version": INT, "group_ids": IDS, "dropped": IDS, "filtered": IDS},
    m.SaveCheckpoint: {"version": INT, "coordinator_state": _Optional(DICT), "metrics": _Optional(DICT),
                       "wait": BOOL},
    m.Stop: {},
    m.Preempt: {"process_id": INT, "signal": STR},
    m.Stopped: {"actor": INT, "stats": _Object(m.ActorStats)},
    m.WarmStartParams: {"params": PLAIN},
    m.MemberRequest: {"uid": INT, "prompt_tokens": _Array("iu", 1), "n_samples": INT, "seed": INT,
                      "max_new_tokens": _Optional(INT), "park": BOOL},
    m.MemberResume: {"evaluation": BOOL, "uid": INT, "sample_index": INT, "observation": _Array("iu", 1),
                     "max_new_tokens": INT},
    m.MemberFinish: {"evaluation": BOOL, "uid": INT, "sample_index": INT},
    m.MemberEvalRequest: {"request": _Object(m.MemberRequest)},
    m.MemberEvalStep: {},
    m.MemberStep: {"call": INT, "requests": _Seq("l", _Object(m.MemberRequest)), "evaluate": BOOL},
    m.MemberReceive: {"version": INT, "hold": BOOL, "checksum": _Optional(FLOAT)},
    m.MemberApply: {"version": INT, "mode": _Optional(STR)},
    m.MemberEvaluate: {"version": INT, "own_weights": BOOL},
    m.MemberPing: {},
    m.MemberReport: {"process_id": INT, "steps": INT, "tokens_generated": INT, "applied_at": DICT,
                     "checksums": DICT, "pulled_bytes": INT},
}  # fmt: skip
# The messages (what `encode` sends and `decode` returns); ActorStats crosses only inside them.
MESSAGE_TYPES = tuple(t for t in SCHEMAS if t.__module__ == m.__name__ and t is not m.ActorStats)
for _t, _fields in SCHEMAS.items():  # a field added to a message must be added to its schema
    assert [f.name for f in dataclasses.fields(_t)] == list(_fields), f"codec schema of {_t.__name__}"


# ----- encoding -----------------------------------------------------------------------------------------


def encode(endpoint: str, message) -> tuple[bytes, bytes]:
    """(body, buffers) of `message` for `endpoint` (see the module docstring).

    Raises:
      CodecError: the message is not a registered type or holds something that cannot cross.
    """
    if type(message) not in MESSAGE_TYPES:
        raise CodecError(f"{type(message).__name__} is not a message type (runtime.messages)")
    buffers: list = []
    tree = _encode(message, buffers, 0)
    body = json.dumps([endpoint, tree], separators=(",", ":"), ensure_ascii=False).encode()
    return body, b"".join(buffers)


def _encode(x, buffers: list, depth: int):
    if depth > 64:
        raise CodecError("nesting too deep to send")
    if x is None or type(x) in (bool, int, float, str):
        return x
    if isinstance(x, np.generic):
        return x.item()
    t = type(x)
    if t in SCHEMAS:
        fields = [_encode(getattr(x, name), buffers, depth + 1) for name in SCHEMAS[t]]
        return ["o", t.__name__, *fields]
    if isinstance(x, (list, tuple)):
        return ["t" if isinstance(x, tuple) else "l", *(_encode(v, buffers, depth + 1) for v in x)]
    if isinstance(x, Mapping):
        out = ["d"]
        for k, v in x.items():
            if type(k) not in (str, int):
                raise CodecError(f"dict key {k!r}: only str and int keys cross")
            out += [k, _encode(v, buffers, depth + 1)]
        return out
    if not isinstance(x, np.ndarray) and hasattr(x, "__array__") and hasattr(x, "dtype"):
        x = np.asarray(x)  # a jax.Array: its host copy
    if isinstance(x, np.ndarray):
        name = _NAMES.get(x.dtype) or _NAMES.get(x.dtype.newbyteorder("<"))
        if name is None:
            raise CodecError(f"arrays of dtype {x.dtype} do not cross")
        flat = np.ascontiguousarray(x).astype(DTYPES[name], copy=False).reshape(-1).view(np.uint8)
        buffers.append(flat.data)  # joined once, in `encode`
        if flat.size % _ALIGN:
            buffers.append(bytes(-flat.size % _ALIGN))
        return ["a", name, list(x.shape)]
    raise CodecError(f"a {t.__name__} cannot cross between processes")


# ----- decoding -----------------------------------------------------------------------------------------


def decode(body: bytes, buffers: bytes, limits: Limits = Limits()) -> tuple[str, object]:
    """(endpoint, message) from `encode`'s bytes.

    Raises:
      CodecError: malformed, oversized, of an unknown type, or not matching its type's schema.
    """
    if len(body) + len(buffers) > limits.max_bytes:
        raise CodecError(f"oversized: {len(body) + len(buffers)} bytes > {limits.max_bytes}")
    try:
        top = json.loads(body)
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, too deep for the parser
        raise CodecError(f"malformed body: {str(e)[:80]}") from None
    if type(top) is not list or len(top) != 2 or type(top[0]) is not str:
        raise CodecError("malformed body: expected [endpoint, message]")
    endpoint, x = top
    if not 0 < len(endpoint) <= limits.max_endpoint:
        raise CodecError("malformed endpoint")
    name = x[1] if type(x) is list and len(x) > 1 and x[0] == "o" and type(x[1]) is str else None
    cls = next((t for t in MESSAGE_TYPES if t.__name__ == name), None)
    if cls is None:
        raise CodecError(f"not a message type: {str(name)[:32]!r}")
    r = _Reader(memoryview(bytearray(buffers)), limits)  # one copy: the arrays are writable
    message = _Object(cls).read(r, x, 0, cls.__name__)
    if r.offset != len(buffers):
        raise CodecError(f"{len(buffers) - r.offset} array bytes belong to no array")
    return endpoint, message


class _Reader:
    """The array bytes of one message and the limits' counters while its body is read."""

    def __init__(self, buffers: memoryview, limits: Limits):
        self.buffers, self.limits = buffers, limits
        self.offset = 0
        self.values = 0

    def count(self) -> None:
        self.values += 1
        if self.values > self.limits.max_values:
            raise CodecError(f"more than {self.limits.max_values} values")

    def container(self, x, tag: str | None, depth: int, path: str) -> list:
        """The items of the tagged container `x` (whose tag must be `tag` unless None)."""
        self.count()
        if type(x) is not list or not x or type(x[0]) is not str or (tag is not None and x[0] != tag):
            raise CodecError(f"{path}: malformed value (expected tag {tag!r})")
        if depth >= self.limits.max_depth:
            raise CodecError(f"{path}: nested deeper than {self.limits.max_depth}")
        return x[1:]

    def array(self, rest: list, path: str) -> np.ndarray:
        if len(rest) != 2 or type(rest[0]) is not str or type(rest[1]) is not list:
            raise CodecError(f"{path}: malformed array")
        dtype, shape = DTYPES.get(rest[0]), rest[1]
        if dtype is None:
            raise CodecError(f"{path}: array dtype {rest[0][:16]!r} is not allowed")
        if len(shape) > self.limits.max_ndim or any(type(d) is not int or d < 0 for d in shape):
            raise CodecError(f"{path}: malformed array shape")
        count = 1
        for d in shape:
            count *= d
            if count * dtype.itemsize > self.limits.max_bytes:
                raise CodecError(f"{path}: array larger than the limit")
        nbytes = count * dtype.itemsize
        start, end = self.offset, self.offset + nbytes
        if end > len(self.buffers):
            raise CodecError(f"{path}: array bytes missing")
        self.offset = end + (-nbytes % _ALIGN)
        return np.frombuffer(self.buffers[start:end], dtype, count).reshape(shape)
