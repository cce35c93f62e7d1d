"""Shared-memory weight slots (runtime/shm_weights.py), both sides in one process: the reader's arrays
are the slot's pages (no copy), and a slot is never rewritten while a reader holds it or has still to
start the version in it. The two-process path runs in tests/test_weight_sync_processes.py."""

import gc
import os
import subprocess

import host_caps
import jax
import numpy as np
import pytest

from jaxrl_async.runtime import shm_weights
from jaxrl_async.runtime.cluster import PeerFailure

pytestmark = pytest.mark.skipif(
    not os.path.isdir(shm_weights.SHM_ROOT), reason=host_caps.reason("shm", "no /dev/shm")
)

SHAPES = [(3, 5), (7,), (2, 2, 2)]


def _version(v: int) -> list[np.ndarray]:
    return [v + np.arange(int(np.prod(s)), dtype=np.float32).reshape(s) for s in SHAPES]


@pytest.fixture
def pair():
    writer = shm_weights.SlotWriter(SHAPES, np.float32, 1, [0], max_slots=2, timeout_s=0.3)
    reader = shm_weights.SlotReader(writer.directory, SHAPES, np.float32, 0, max_slots=2, timeout_s=0.3)
    yield writer, reader
    writer.close()


def _take(reader, v, wanted=(0, 1, 2)):
    views = reader.take(v, list(wanted))
    return jax.device_put(views, [jax.devices()[0]] * len(views))


def test_pieces_arrive_in_place_with_their_values(pair):
    writer, reader = pair
    writer.write(0, _version(0))
    views = reader.take(0, [0, 1, 2])
    arrays = jax.device_put(views, [jax.devices()[0]] * 3)
    for a, v, want in zip(arrays, views, _version(0), strict=True):
        np.testing.assert_array_equal(np.asarray(a), want)
        assert a.unsafe_buffer_pointer() == v.ctypes.data  # the slot's own pages: nothing was copied
        assert v.ctypes.data % shm_weights.ALIGN == 0
    assert sorted(os.listdir(writer.directory)) == ["control", "slot0", "slot1"]  # two made up front


def test_a_held_slot_is_not_rewritten_and_the_writer_names_the_holder(pair):
    writer, reader = pair
    writer.write(0, _version(0))
    v0 = _take(reader, 0)
    writer.write(1, _version(1))  # the second slot
    v1 = _take(reader, 1)
    with pytest.raises(TimeoutError, match=r"version 2 within .*held by readers \[0\]"):
        writer.write(2, _version(2))  # both slots are held: bounded memory, the writer waits
    del v0
    gc.collect()
    assert writer.write(2, _version(2)) == 0  # version 0's slot, once its arrays are gone
    v2 = _take(reader, 2)
    for a, b, want1, want2 in zip(v1, v2, _version(1), _version(2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), want1)  # still version 1: not overwritten
        np.testing.assert_array_equal(np.asarray(b), want2)


def test_a_version_not_yet_started_keeps_its_slot(pair):
    writer, reader = pair
    writer.write(0, _version(0))
    writer.write(1, _version(1))
    with pytest.raises(TimeoutError, match="not yet started by"):
        writer.write(2, _version(2))  # the reader was told of 0 and 1 and has taken neither
    arrays = _take(reader, 0)
    del arrays
    gc.collect()
    assert writer.write(2, _version(2)) == 0
    np.testing.assert_array_equal(np.asarray(_take(reader, 1)[1]), _version(1)[1])


def test_a_reader_waits_for_a_version_and_says_which_did_not_come(pair):
    _, reader = pair
    with pytest.raises(TimeoutError, match="version 5 did not appear in shared memory"):
        reader.take(5, [0])


def test_bfloat16_pieces_travel_as_their_bits():
    bf16 = jax.numpy.bfloat16
    writer = shm_weights.SlotWriter([(4,)], bf16, readers=1, shm_readers=[0])
    try:
        reader = shm_weights.SlotReader(writer.directory, [(4,)], bf16, 0)
        x = np.array([1.5, -2.0, 3.25, 0.0], bf16)
        writer.write(0, [x.view(np.uint16)])  # numpy takes bfloat16 from JAX only as uint16 bits
        (got,) = reader.take(0, [0])
        assert got.dtype == bf16
        np.testing.assert_array_equal(got, x)
    finally:
        writer.close()
    assert not os.path.exists(writer.directory)


def test_a_writer_waiting_on_a_dead_reader_names_it(pair):
    writer, reader = pair
    held = [_take(reader, v) for v in range(2) if writer.write(v, _version(v)) is not None]
    dead = subprocess.Popen(["true"])
    dead.wait()
    reader.ctrl.pids[0] = dead.pid  # the reader's process, as the writer sees it, is gone
    with pytest.raises(PeerFailure, match=rf"pulls \[0\] \(OS pids \[{dead.pid}\]\) are gone"):
        writer.write(2, _version(2))
    assert len(held) == 2
