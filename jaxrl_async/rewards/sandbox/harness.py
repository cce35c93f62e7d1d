"""The grading harness: the main program of a sandboxed test run.

The sandbox runs `main` (importing this file from a read-only, precompiled copy; `sandbox.py`) with
argv `JOB_FD REPORT_FD GUARD` under two fresh uids: the real uid U+1 and the effective and saved uid U.
It forks at once, before reading anything:

  * the **program process** switches to uid U for good, closes the job and report descriptors, loads
    the candidate's `main.py` as module `solution` and then serves requests from the judge: look up a
    global, call, get an attribute or item, iterate, ...;
  * the **judge** drops the saved uid (so the program process can neither signal nor trace it, and
    `/proc` hides it), reads the job (a random nonce, then the test code or the calls to make) and runs
    it, reaching the program only through requests. Values cross as plain data (None, bool, int,
    float, complex, str, bytes, list, tuple, dict, set, frozenset, copied; subclasses of these are
    copied as their builtin base), so no code of the candidate runs in the judge: its `__eq__`,
    `__bool__` or `__sub__` never decide an assert. Anything else arrives as an opaque handle that
    compares by identity.

Only the judge holds the report descriptor and the nonce; it writes `[nonce, kind, ...]` lines on it:
("case", i, result) per call and ("pass",) once all of `test_code` ran without an exception. The grader
reads nothing else as success: not the exit status, not stdout.

Stdlib only (with wire.py, the codec and the job and report formats): it runs under the sandbox's
interpreter.
"""

from __future__ import annotations

import builtins
import os
import sys
import types

from jaxrl_async.rewards.sandbox.wire import PROGRAM, SOCKET_GUARD, decode, dumps, encode, loads

_MAX_MESSAGE = 16 << 20  # bytes of one message from the program process
_MODULE = "solution"


# ---- the judge: runs the tests, reaches the program only through requests --------------------------------


class ProgramGone(BaseException):
    """The program process died or broke the protocol; a BaseException so test code cannot catch it."""


class _Link:
    """The judge's end of the request/response pipes."""

    def __init__(self, rfd: int, wfd: int):
        self.rfd, self.wfd, self.buf, self.broken = rfd, wfd, b"", None

    def read(self):
        while b"\n" not in self.buf:
            if len(self.buf) > _MAX_MESSAGE:
                self.fail("a response exceeded the size limit")
            try:
                chunk = os.read(self.rfd, 1 << 16)
            except OSError as e:
                self.fail(f"read failed: {e}")
            if not chunk:
                self.fail("the program process exited")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            msg = loads(line)
        except (ValueError, RecursionError, MemoryError):
            self.fail("malformed response")
        if type(msg) is not list or not msg or type(msg[0]) is not str:
            self.fail("malformed response")
        return msg

    def fail(self, why: str):
        self.broken = self.broken or why
        raise ProgramGone(why)

    def request(self, *req, mutable_args=()):
        if self.broken:
            raise ProgramGone(self.broken)
        data = dumps(list(req))
        while data:
            try:
                data = data[os.write(self.wfd, data) :]
            except OSError as e:
                self.fail(f"write failed: {e}")
        msg = self.read()
        try:
            if msg[0] == "ok" and len(msg) == 3:
                for (where, tree), obj in zip(msg[2], mutable_args, strict=True):
                    _write_back(obj, decode(tree, _from_program), where)
                return decode(msg[1], _from_program)
            if msg[0] == "raise" and len(msg) == 2:
                exc = _exception(msg[1])
            else:
                exc = None
        except (ValueError, TypeError, KeyError, IndexError, RecursionError, MemoryError) as e:
            self.fail(f"malformed response: {e!r}")
        if exc is None:
            self.fail(f"unexpected response {msg[0]!r}")
        if isinstance(exc, StopIteration | StopAsyncIteration) and req[0] != "next":
            # As PEP 479 does for generators: a StopIteration escaping a call would silently end an
            # enclosing loop of the test code (`all(map(f, xs))` would pass).
            raise RuntimeError(f"the program raised {type(exc).__name__} outside iteration")
        raise exc


_LINK: _Link | None = None  # set in the judge process only


def _request(*req, mutable_args=()):
    return _LINK.request(*req, mutable_args=mutable_args)


def _write_back(obj, new, where):
    """Mirrors an in-place change the program made to a list/dict/set argument onto the judge's object."""
    if type(obj) is not type(new):
        raise TypeError(f"argument {where} changed type")
    if type(obj) is list:
        obj[:] = new
    else:
        obj.clear()
        obj.update(new)


def _to_program(x):
    """Encodes a judge-side value for a request: plain data, or handles the program gave us."""

    def handle(obj):
        if type(obj) is Remote:
            return ["h", object.__getattribute__(obj, "_hid")]
        hid = _MIRROR_IDS.get(obj)
        if hid is not None:
            return ["h", hid]
        raise TypeError(f"test code passed a {type(obj).__qualname__} to the program; only plain data and "
                        "objects that came from the program can be passed")

    return encode(x, handle)


def _call_request(op, target, args, kwargs):
    mutable = [(i, a) for i, a in enumerate(args) if type(a) in (list, dict, set)]
    mutable += [(k, v) for k, v in kwargs.items() if type(v) in (list, dict, set)]
    return _request(op, target, _to_program(list(args)), _to_program(dict(kwargs)),
                    [w for w, _ in mutable], mutable_args=[a for _, a in mutable])


class Remote:
    """An object that lives in the program process. It compares and hashes by identity (the program's
    `__eq__` is never consulted); calls, attributes, items, len, iter, next, bool, str, int, float and
    isinstance are requests whose results come back as plain data or further handles."""

    __slots__ = ("_hid", "_kind", "_name")

    def __init__(self, hid: int, kind: str, name: str):
        object.__setattr__(self, "_hid", hid)
        object.__setattr__(self, "_kind", kind)
        object.__setattr__(self, "_name", name)

    def _id(self):
        return object.__getattribute__(self, "_hid")

    def __call__(self, *args, **kwargs):
        return _call_request("call", self._id(), args, kwargs)

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _request("getattr", self._id(), name)

    def __setattr__(self, name, value):
        _request("setattr", self._id(), name, _to_program(value))

    def __getitem__(self, key):
        return _request("getitem", self._id(), _to_program(key))

    def __setitem__(self, key, value):
        _request("setitem", self._id(), _to_program(key), _to_program(value))

    def __delitem__(self, key):
        _request("delitem", self._id(), _to_program(key))

    def __len__(self):
        return _request("len", self._id())

    def __iter__(self):
        return _request("iter", self._id())

    def __next__(self):
        return _request("next", self._id())

    def __bool__(self):
        return _request("bool", self._id())

    def __str__(self):
        return _request("str", self._id())

    def __repr__(self):
        return _request("repr", self._id())

    def __format__(self, spec):
        return _request("format", self._id(), spec)

    def __int__(self):
        return _request("int", self._id())

    def __index__(self):
        return _request("index", self._id())

    def __float__(self):
        return _request("float", self._id())

    def __instancecheck__(self, obj):
        return _request("isinstance", _to_program(obj), self._id())

    def __subclasscheck__(self, cls):
        return _request("issubclass", _to_program(cls), self._id())


_REMOTES: dict[int, Remote] = {}
_MIRRORS: dict[int, type] = {}  # program class handle -> judge-side exception class
_MIRROR_IDS: dict[type, int] = {}


def _plain_init(self, *args):
    BaseException.__init__(self, *args)


def _builtin_exception(name: str) -> type:
    cls = getattr(builtins, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, BaseException) else Exception


def _mirror(chain, base: str) -> type:
    """The judge-side class for a program exception class: `chain` is [[hid, qualname], ...] from the
    class up to (not including) its first builtin base `base`."""
    cls = _builtin_exception(base)
    for hid, name in reversed(chain):
        if hid not in _MIRRORS:
            _MIRRORS[hid] = type(str(name), (cls,), {"__module__": _MODULE, "__init__": _plain_init})
            _MIRROR_IDS[_MIRRORS[hid]] = hid
        cls = _MIRRORS[hid]
    return cls


def _exception(info) -> BaseException:
    """The exception the program raised, rebuilt in the judge: builtin classes as themselves, program
    classes as mirrors (so `except TheirError:` in test code works)."""
    chain, base, message = info
    cls = _mirror(chain, base) if chain else _builtin_exception(base)
    try:
        return cls(str(message))
    except Exception:  # noqa: BLE001 - e.g. UnicodeDecodeError needs 5 arguments
        return type(cls.__name__, (cls,), {"__init__": _plain_init})(str(message))


def _from_program(tree) -> object:
    """Decodes a handle from the program: exception classes become mirrors, the rest Remote."""
    if len(tree) == 5 and tree[2] == "exc_class":
        return _mirror(tree[4][0], tree[4][1])
    if len(tree) != 4 or type(tree[1]) is not int:
        raise ValueError("malformed handle")
    if tree[1] not in _REMOTES:  # one Remote per program object, so `is` and == agree with the program's
        _REMOTES[tree[1]] = Remote(tree[1], str(tree[2]), str(tree[3]))
    return _REMOTES[tree[1]]


class _Names(dict):
    """Builtins for the test code: the judge's own builtins first (so a program cannot shadow `abs`,
    `len` or `isinstance` for the test code), then the program's globals, fetched once when first used."""

    def __missing__(self, name):
        found = _request("get", name)
        if found is None:
            raise KeyError(name)
        self[name] = found[0]
        return found[0]


class _Report:
    def __init__(self, fd: int, nonce: str):
        self.fd, self.nonce = fd, nonce

    def __call__(self, *record):
        data = dumps([self.nonce, *record])
        while data:
            data = data[os.write(self.fd, data) :]


def _where(exc: BaseException) -> str:
    tb, line = exc.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<test_code>":
            line = tb.tb_lineno
        tb = tb.tb_next
    text = str(exc)[:200]
    where = f" (test_code line {line})" if line else ""
    return f"{type(exc).__name__}{': ' + text if text else ''}{where}"


class _ProgramModule(types.ModuleType):
    """`solution` as the test code imports it (`from solution import f`): attributes are requests."""

    def __getattr__(self, name):
        found = _request("get", name)
        if found is None:
            raise AttributeError(f"the program defines no {name!r}")
        return found[0]


def _run_test_code(job, report):
    sys.modules[_MODULE] = _ProgramModule(_MODULE)
    names = _Names(vars(builtins))
    scope = {"__name__": "__test__", "__builtins__": names}
    try:
        exec(compile(job["test_code"], "<test_code>", "exec"), scope)
    except ProgramGone as e:
        report("fail", f"program process: {e}")
    except BaseException as e:  # noqa: BLE001 - SystemExit from test code is a failure too
        report("fail", _where(e))
    else:
        if _LINK.broken:
            report("fail", f"program process: {_LINK.broken}")
        else:
            report("pass")


def _run_calls(job, report):
    """Calls `entry_point` with each case's arguments; reports each result (compared by the grader)."""
    head, _, method = job["entry_point"].partition(".")
    found = _request("get", head)
    if found is None:
        report("fail", f"the program defines no {head!r}")
        return
    target = found[0]
    opaque = lambda r: ["h", 0, "object", object.__getattribute__(r, "_name") if type(r) is Remote else "?"]
    for i, (args, kwargs) in enumerate(job["calls"]):
        try:
            fn = getattr(target(), method) if method else target
            value = fn(*decode(args), **decode(kwargs))
            report("case", i, ["ok", encode(value, opaque)])
        except ProgramGone as e:
            report("fail", f"program process: {e}")
            return
        except BaseException as e:  # noqa: BLE001
            report("case", i, ["raise", type(e).__name__, str(e)[:200]])


def _judge(job_fd: int, report_fd: int, link: _Link):
    global _LINK
    _LINK = link
    with os.fdopen(job_fd, "rb") as f:
        job = loads(f.read())
    report = _Report(report_fd, job["nonce"])
    try:
        hello = link.read()
        if hello[0] != "loaded":
            report("fail", "the program did not load: " + ": ".join(map(str, hello[1:3])))
            return
        {"test_code": _run_test_code, "calls": _run_calls}[job["mode"]](job, report)
    except ProgramGone as e:
        report("fail", f"program process: {e}")


# ---- the program process: loads the candidate, serves the judge's requests -------------------------------


def _program(rfd: int, wfd: int, guard: bool):
    """Loads main.py as module `solution`, then answers requests until the judge goes away."""
    read, write, exit_ = os.read, os.write, os._exit
    objs: dict[int, object] = {}
    hids: dict[int, int] = {}  # id(obj) -> handle; objs keeps every object alive, so ids stay unique

    def send(msg):
        data = dumps(msg)
        while data:
            data = data[write(wfd, data) :]

    def register(obj) -> int:
        hid = hids.get(id(obj))
        if hid is None:
            hid = hids[id(obj)] = len(objs) + 1
            objs[hid] = obj
        return hid

    def exception_info(cls: type) -> list:
        """[[[handle, qualname], ...] up to the first builtin base, that base's name] of a class."""
        chain = []
        for klass in cls.__mro__:
            if klass.__module__ == "builtins":
                return [chain, klass.__name__]
            chain.append([register(klass), klass.__qualname__])
        return [chain, "Exception"]

    def handle(obj):
        if isinstance(obj, type):
            if issubclass(obj, BaseException):
                return ["h", register(obj), "exc_class", obj.__qualname__, exception_info(obj)]
            return ["h", register(obj), "class", obj.__qualname__]
        return ["h", register(obj), "object", type(obj).__qualname__]

    def arg(tree):
        return decode(tree, lambda h: objs[h[1]])

    if guard:
        exec(SOCKET_GUARD, {})
    module = types.ModuleType(_MODULE)
    module.__file__ = os.path.abspath(PROGRAM)
    sys.modules[_MODULE] = module
    sys.argv = [PROGRAM]  # as when the program runs as the main program
    try:
        with open(PROGRAM, encoding="utf-8") as f:
            code = compile(f.read(), PROGRAM, "exec")
        exec(code, module.__dict__)
    except BaseException as e:  # noqa: BLE001 - includes SystemExit: the program may not end the run
        send(["load_error", type(e).__name__, _safe_str(e)])
        return
    scope = module.__dict__
    ops = {
        "get": lambda name: (scope[name],) if name in scope else None,
        "getattr": lambda h, name: getattr(objs[h], name),
        "setattr": lambda h, name, v: setattr(objs[h], name, arg(v)),
        "getitem": lambda h, k: objs[h][arg(k)],
        "setitem": lambda h, k, v: objs[h].__setitem__(arg(k), arg(v)),
        "delitem": lambda h, k: objs[h].__delitem__(arg(k)),
        "len": lambda h: len(objs[h]),
        "iter": lambda h: iter(objs[h]),
        "next": lambda h: next(objs[h]),
        "bool": lambda h: bool(objs[h]),
        "str": lambda h: str(objs[h]),
        "repr": lambda h: repr(objs[h]),
        "format": lambda h, spec: format(objs[h], spec),
        "int": lambda h: int(objs[h]),
        "index": lambda h: objs[h].__index__(),
        "float": lambda h: float(objs[h]),
        "isinstance": lambda x, h: isinstance(arg(x), objs[h]),
        "issubclass": lambda x, h: issubclass(arg(x), objs[h]),
    }
    send(["loaded"])
    buf = b""
    while True:
        while b"\n" not in buf:
            chunk = read(rfd, 1 << 16)
            if not chunk:
                exit_(0)
            buf += chunk
        line, buf = buf.split(b"\n", 1)
        try:
            req = loads(line)
            if req[0] == "call":
                _, h, args, kwargs, mutable = req
                args, kwargs = arg(args), arg(kwargs)
                value = objs[h](*args, **kwargs)
                back = [[w, encode(args[w] if type(w) is int else kwargs[w], handle)] for w in mutable]
                send(["ok", encode(value, handle), back])
            else:
                send(["ok", encode(ops[req[0]](*req[1:]), handle), []])
        except BaseException as e:  # noqa: BLE001 - everything the program raises goes back to the judge
            send(["raise", [*exception_info(type(e)), _safe_str(e)]])


def _safe_str(e: BaseException) -> str:
    try:
        return str(e)[:500]
    except BaseException:  # noqa: BLE001
        return "<unprintable>"


def main(argv):
    job_fd, report_fd, guard = int(argv[1]), int(argv[2]), argv[3] == "1"
    ruid, _, suid = os.getresuid()
    rgid, _, sgid = os.getresgid()
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setresgid(sgid, sgid, sgid)
            os.setresuid(suid, suid, suid)
            for fd in (job_fd, report_fd, req_w, resp_r):
                os.close(fd)
            _program(req_r, resp_w, guard)
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except BaseException:  # noqa: BLE001, S110
                    pass
            os._exit(0)
    os.setresgid(rgid, rgid, rgid)
    os.setresuid(ruid, ruid, ruid)
    os.close(req_r)
    os.close(resp_w)
    _judge(job_fd, report_fd, _Link(resp_r, req_w))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv)
