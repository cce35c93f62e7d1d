"""The schedule log (runtime/schedule_log.py): records read back whole, a line cut by a kill ends the
record at the last complete entry, and the parameter fingerprint sees any changed bit."""

import os
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np

from jaxrl_async.runtime.schedule_log import (
    ScheduleWriter,
    encode,
    fingerprint,
    read_schedule,
    schedule_path,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write(path, records):
    w = ScheduleWriter(path)
    for r in records:
        w.write(r)
    w.close()
    return w


def test_records_read_back_in_order(tmp_path):
    path = schedule_path(str(tmp_path), "actor:0")
    assert path.endswith("schedule/actor-0.jsonl")
    records = [{"c": i, "add": [[i, f"0:{i}"]]} for i in range(20)]
    w = _write(path, records)
    got = read_schedule(path)
    assert got.records == records and not got.truncated
    assert got.bytes == w.bytes == os.path.getsize(path)


def test_a_cut_last_line_reads_up_to_the_last_complete_record(tmp_path):
    path = str(tmp_path / "s.jsonl")
    records = [{"t": v, "g": list(range(v, v + 4)), "fp": 12345 + v} for v in range(1, 6)]
    _write(path, records)
    data = open(path, "rb").read()
    last = data.rindex(b"\n", 0, len(data) - 1) + 1  # where the last line starts
    for cut in range(last, len(data)):  # every cut inside the last line, its newline included
        with open(path, "wb") as f:
            f.write(data[:cut])
        got = read_schedule(path)
        assert got.records == records[:-1], cut
        assert got.truncated == (cut > last), cut
    # A damaged line in the middle ends the record there too (what follows it cannot be trusted).
    lines = data.decode().splitlines(keepends=True)
    lines[2] = lines[2].replace('"t":3', '"t":4')
    with open(path, "w") as f:
        f.write("".join(lines))
    got = read_schedule(path)
    assert got.records == records[:2] and got.truncated


_WRITER = """
import sys
from jaxrl_async.runtime.schedule_log import ScheduleWriter
w = ScheduleWriter(sys.argv[1])
i = 0
while True:  # lines of ~40 KB: each flush is several write() calls, so a kill can cut one
    w.write({"c": i, "add": [[i, "0:%d" % j] for j in range(4000)]})
    i += 1
    if i == 3:
        print("writing", flush=True)
"""


def test_sigkill_while_writing_leaves_a_readable_prefix(tmp_path):
    path = str(tmp_path / "killed.jsonl")
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, path], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    got = read_schedule(path)
    assert len(got.records) >= 3
    assert [r["c"] for r in got.records] == list(range(len(got.records)))
    assert all(len(r["add"]) == 4000 for r in got.records)
    # whatever follows the last complete record is a cut line (or nothing)
    size = os.path.getsize(path)
    complete = sum(len(encode(r)) + 1 for r in got.records)
    assert got.truncated == (size > complete)


def test_fingerprint_sees_one_changed_bit():
    rng = np.random.default_rng(0)
    params = {"a": jnp.asarray(rng.standard_normal((64, 33)), jnp.float32),
              "b": jnp.asarray(rng.standard_normal((7,)), jnp.bfloat16)}  # fmt: skip
    base = fingerprint(params)
    assert base == fingerprint({k: v + 0 for k, v in params.items()})  # same bits, same value
    for leaf in ("a", "b"):
        x = np.asarray(params[leaf])
        words = x.view(np.uint32 if x.dtype == np.float32 else np.uint16).copy()
        for idx, bit in ((0, 0), (5, 31 if leaf == "a" else 15), (words.size - 1, 7)):
            flipped = words.copy().reshape(-1)
            flipped[idx] ^= 1 << bit
            changed = dict(params, **{leaf: jnp.asarray(flipped.view(x.dtype).reshape(x.shape))})
            assert fingerprint(changed) != base, (leaf, idx, bit)
    swapped = dict(params, a=params["a"][::-1])  # same values, other positions
    assert fingerprint(swapped) != base


def test_record_schedule_is_on_for_async_runs_by_default():
    import pytest

    from configs import tiny_arith
    from jaxrl_async.run_config import ConfigError, validate

    c = tiny_arith.get_config()
    c.workdir = "/tmp/unused"
    assert c.record_schedule == "auto" and validate(c).record_schedule  # tiny_arith is async
    c.mode = "sync"
    assert not validate(c).record_schedule  # a sync run is reproducible from its seeds alone
    c.record_schedule = "on"
    assert validate(c).record_schedule
    c.record_schedule = "yes"
    with pytest.raises(ConfigError, match="config.record_schedule"):
        validate(c)


def test_a_resumed_process_reads_past_the_line_its_killed_predecessor_cut(tmp_path):
    path = str(tmp_path / "learner.jsonl")
    first = [{"start": "learner", "version": 0}, {"t": 1}, {"t": 2}]
    _write(path, first)
    data = open(path, "rb").read()
    with open(path, "wb") as f:  # the kill cut the last record, newline and all
        f.write(data[:-7])
    second = [{"start": "learner", "version": 1}, {"t": 2}, {"t": 3}]
    _write(path, second)
    got = read_schedule(path)
    assert got.records == first[:2] + second and got.truncated
