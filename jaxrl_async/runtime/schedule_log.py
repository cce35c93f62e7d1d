"""The schedule log: the decisions that timing made in an asynchronous run, recorded so that
`runtime/replay.py` can run the same run again in one process, bit for bit (docs/reproducibility.md).

Given the config, everything else a run does is a function of these decisions:

  actor   before each decode call (`SamplerLoop.step`): the requests queued since the last call (group
          id and prompt key; the sampling stream is seed * 1_000_003 + group id, tickets.py) and the
          versions applied (with their update mode). Admission inside the loop is then deterministic.
          Each reward result that went into a group (a sandbox timeout is not deterministic), with a
          CRC of the completion's tokens so that a replay names the first completion that differs.
          Multi-turn episodes (config.env): each environment's answer (observation, reward, end), at the
          decode call after which it was applied (when a parked slot resumes is timing's choice, and a
          tool's answer may be the outside world's: a clock, a timeout, randomness), with a CRC of the
          turn it answered. Admission is the requests, as for single-turn runs.
  learner each train step: its groups, in order, the version it produced and a fingerprint of the train
          state's parameters (`fingerprint`, exact: any changed bit changes it).

Each process writes its own file, WORKDIR/schedule/<endpoint>.jsonl (`schedule_path`), through
`storage.AppendLog` (a bucket workdir works). Each line is "<crc32 hex> <json>": a line that a kill cut
short, or one damaged later, fails its CRC, and `read_schedule` keeps that process's records up to the
last complete one before it. Every process start begins with a {"start": ...} record, so a resumed run's
segments are told apart (and read past a line its killed predecessor left cut).
Calls on which nothing happened (an idle loop, nothing new queued or applied) are not recorded: such a
`step` changes no state.
"""

from __future__ import annotations

import dataclasses
import json
import time
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_async import storage

# A bucket object cannot be appended to: AppendLog rewrites it whole on each write, so a bucket record is
# written in batches at most this often (a kill loses at most this much of it); a local file gets each
# record at once.
REMOTE_FLUSH_S = 30.0


def schedule_path(workdir: str, endpoint: str) -> str:
    """Where `endpoint` ("learner", "actor:0") writes its record ("actor:0" -> actor-0.jsonl)."""
    return storage.join(workdir, "schedule", endpoint.replace(":", "-") + ".jsonl")


def encode(record: dict) -> str:
    body = json.dumps(record, separators=(",", ":"))
    return f"{zlib.crc32(body.encode()):08x} {body}"


def decode(line: str) -> dict | None:
    """The record of one line, or None when the line is incomplete or damaged (its CRC does not match)."""
    crc, sep, body = line.rstrip("\n").partition(" ")
    if not sep or len(crc) != 8:
        return None
    try:
        if int(crc, 16) != zlib.crc32(body.encode()):
            return None
        return json.loads(body)
    except ValueError:
        return None


@dataclasses.dataclass
class Record:
    """A schedule file read back: its complete records, and whether anything after them was dropped."""

    records: list[dict]
    truncated: bool  # a line failed its check (a kill cut it, or later damage): it and what follows dropped
    bytes: int  # the file's size, for the bytes-per-step figure


def read_schedule(path: str) -> Record:
    """Reads a schedule file: each process start's records up to its last complete one (see the module
    docstring). After a line that fails its check nothing is trusted until the next start record (the
    records of a later process: a resumed run)."""
    text = storage.read_text(path)
    records, truncated, skipping = [], False, False
    for line in text.splitlines(keepends=True):
        rec = decode(line) if line.endswith("\n") else None  # no newline: the write was cut
        if rec is None:
            truncated = skipping = True
        elif not skipping or "start" in rec:
            records.append(rec)
            skipping = False
    return Record(records, truncated, len(text.encode()))


def _ends_a_line(path: str) -> bool:
    with open(path, "rb") as f:  # a local file (storage.is_url is False)
        f.seek(0, 2)
        if f.tell() == 0:
            return True
        f.seek(-1, 2)
        return f.read(1) == b"\n"


class ScheduleWriter:
    """Appends records to a schedule file (see the module docstring); counts the bytes written."""

    def __init__(self, path: str, flush_s: float | None = None):
        self.path = path
        storage.makedirs(str(storage.path(path).parent))
        target = storage.path(path)
        # A kill may have cut the last line of a local file: end it, so this process's first record
        # starts a line of its own (the cut one fails its check and is skipped).
        cut = target.exists() and not storage.is_url(path) and not _ends_a_line(path)
        self._log = storage.AppendLog(path)
        if cut:
            self._log.write("")
        self.flush_s = (REMOTE_FLUSH_S if self._log.remote else 0.0) if flush_s is None else flush_s
        self._buffer: list[str] = []
        self._flushed = time.monotonic()
        self.bytes = 0

    def write(self, record: dict) -> None:
        line = encode(record)
        self.bytes += len(line) + 1
        self._buffer.append(line)
        if time.monotonic() - self._flushed >= self.flush_s:
            self.flush()

    def flush(self) -> None:
        if self._buffer:
            self._log.write("\n".join(self._buffer))  # one write: whole lines, each checked on reading
            self._buffer = []
        self._flushed = time.monotonic()

    def close(self) -> None:
        self.flush()
        self._log.close()


def token_crc(tokens) -> int:
    """CRC32 of token ids as int32 words: what the record keeps of a completion or a turn."""
    return zlib.crc32(np.asarray(tokens, np.int32).tobytes())


def last_turn(episode) -> list:
    """The tokens of an episode's last model turn (after its last observation)."""
    start = len(episode.model_mask)
    while start > 0 and episode.model_mask[start - 1]:
        start -= 1
    return episode.tokens[start:]


def _plain(observation):
    """An observation as JSON holds it: text, a list of token ids, or None."""
    if observation is None or isinstance(observation, str):
        return observation
    return [int(t) for t in observation]


@jax.jit
def _fingerprint(tree):
    # Integer arithmetic mod 2^32 is exact and associative: the same bits give the same value however the
    # sum is split over devices (so a sharded train state and a replayed one compare), and a change of any
    # one bit changes it (each word is multiplied by an odd weight, invertible mod 2^32).
    total = jnp.zeros((), jnp.uint32)
    for x in jax.tree.leaves(tree):
        width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
        bits = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32).reshape(-1)
        odd = jax.lax.iota(jnp.uint32, bits.size) * jnp.uint32(2) + jnp.uint32(1)
        total = total * jnp.uint32(0x9E3779B1) + jnp.sum(bits * odd, dtype=jnp.uint32)
    return total


def fingerprint(params) -> int:
    """An exact fingerprint of a parameter tree (one pass on its devices, one scalar read back). Every
    process holding shards of `params` must call it (one SPMD computation)."""
    return int(np.asarray(_fingerprint(params).addressable_shards[0].data))


class NoSchedule:
    """The recorder of a run that records nothing: every hook is a no-op."""

    def added(self, request) -> None:
        pass

    def applied(self, version: int, mode: str | None, loop) -> None:
        pass

    def calling(self, loop) -> None:
        pass

    def graded(self, result, completion) -> None:
        pass

    def answered(self, episode, result) -> None:
        pass

    def started(self, version: int, params) -> None:
        pass

    def trained(self, version: int, groups, params) -> None:
        pass

    def close(self) -> None:
        pass


class ActorSchedule(NoSchedule):
    """An actor's recorder: its hooks sit at the decision points of `Actor` (queueing a request, applying
    a version, calling the loop, taking a reward result).


    Args:
      writer: the actor's schedule file.
      endpoint: the actor's endpoint ("actor:0").
      engine_cfg: the sampling engine's SamplerConfig, "auto" kernels resolved: a choice made by timing
        on the machine, so the replay builds its engine with the same kernels (the same numerics).
    """

    def __init__(self, writer: ScheduleWriter, endpoint: str, engine_cfg):
        self.writer = writer
        self.calls = 0  # decode calls (`step`) so far, recorded or not
        self._added: list[list[Any]] = []
        self._applied: list[list[Any]] = []
        self._graded: list[list[Any]] = []
        self._answers: list[list[Any]] = []  # environments' answers applied during the last call
        writer.write({"start": endpoint, "attention": engine_cfg.attention, "linear": engine_cfg.linear})

    def added(self, request) -> None:
        self._added.append([int(request.uid), request.metadata.key])

    def applied(self, version: int, mode: str | None, loop) -> None:
        # num_live: sequences that go on under the new weights (an in-flight update when > 0)
        self._applied.append([int(version), mode, loop.num_live])

    def calling(self, loop) -> None:
        """Before `loop.step`: records the call unless it changes nothing (idle, nothing new), after the
        reward results taken since the last call."""
        self._write_answers()
        self._write_graded()
        if self._added or self._applied or not loop.idle:
            rec: dict[str, Any] = {"c": self.calls}
            if self._applied:
                rec["apply"] = self._applied
            if self._added:
                rec["add"] = self._added
            self.writer.write(rec)
            self._added, self._applied = [], []
        self.calls += 1

    def graded(self, result, completion) -> None:
        """A reward result that goes into a group: [group, sample, reward, tokens' CRC(, reason)], the
        reason only when it is not "ok". Written with the next call (one record for all of them: a
        record per result cost twice the bytes)."""
        gid, sample = result.request_id
        if isinstance(completion, tuple):  # a multi-turn episode (with its prompt): the whole episode
            completion = completion[0]
        rec = [int(gid), int(sample), float(result.reward), token_crc(completion.tokens)]
        if result.reason != "ok":
            rec.append(result.reason)
        self._graded.append(rec)

    def answered(self, episode, result) -> None:
        """An environment's answer to an episode's last turn, applied after the last decode call:
        [group, sample, the turn's CRC, observation, reward(, reason)], the reason when the answer ends
        the episode. Written with the next call, as one {"o": [...], "at": call} record."""
        rec = [int(episode.uid), int(episode.sample_index), token_crc(last_turn(episode)),
               _plain(result.observation), float(result.reward)]  # fmt: skip
        if result.done:
            rec.append(str(result.info.get("reason", "done")))
        self._answers.append(rec)

    def _write_answers(self) -> None:
        if self._answers:
            self.writer.write({"o": self._answers, "at": self.calls - 1})
            self._answers = []

    def _write_graded(self) -> None:
        if self._graded:
            self.writer.write({"r": self._graded})
            self._graded = []

    def close(self) -> None:
        self._write_answers()
        self._write_graded()
        self.writer.close()


class LearnerSchedule(NoSchedule):
    """The learner lead's recorder: the version it starts at and each train step.

    Args:
      writer: the learner's schedule file.
      fingerprints: whether to fingerprint the parameters (only with one trainer process: with several,
        the fingerprint is a collective that the followers would have to join).
    """

    def __init__(self, writer: ScheduleWriter, fingerprints: bool = True):
        self.writer, self.fingerprints = writer, fingerprints

    def _fp(self, params) -> int | None:
        return fingerprint(params) if self.fingerprints else None

    def started(self, version: int, params) -> None:
        self.writer.write({"start": "learner", "version": int(version), "fp": self._fp(params)})

    def trained(self, version: int, groups, params) -> None:
        """A train step ended at `version` (unchanged when every update was non-finite)."""
        gids = [int(g[0].group_id) for g in groups]
        self.writer.write({"t": int(version), "g": gids, "fp": self._fp(params)})

    def close(self) -> None:
        self.writer.close()
