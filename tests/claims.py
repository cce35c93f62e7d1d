"""Checkers of two claims that the run tests and their break tests (tests/test_claim_checks.py) share, so a
break test exercises the very check a run test makes:

- claim 3, exact resume across processes: the ledger (trained_uids.jsonl) after a kill and a resume holds
  every version once, each on a full batch, no prompt in two versions, and every prompt the coordinator
  started either trained once or still in flight at the end (none lost);
- claim 9, the per-token staleness bound: at every train step no token came from a policy more than η
  versions older than the one it trains, nor from an older policy than its sample's first token.
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Iterable


def read_ledger(workdir) -> dict[int, list[str]]:
    """trained_uids.jsonl as version -> uids; after a resume a version's last line is the one that counts
    (a version trained, then lost with its process before a checkpoint, is trained again)."""
    last = {}
    with open(os.path.join(workdir, "trained_uids.jsonl")) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                last[row["version"]] = row["uids"]
    return last


def ledger_problems(last: dict[int, list[str]], steps: int, per_version: int, *,
                    epoch: Iterable[str] | None = None, started: int | None = None,
                    in_flight: Iterable[str] | None = None) -> list[str]:  # fmt: skip
    """What is wrong with a ledger (`read_ledger`) of a run of `steps` versions of `per_version` prompts:
    a version missing or extra, a version not trained on a full batch, a prompt trained in two versions;
    with `epoch` (every prompt key of a run that trains exactly one epoch), a prompt never trained or one
    from outside it; with `started` and `in_flight` (the coordinator's state at the run's last checkpoint:
    its admission count and the keys still in flight), a prompt both trained and in flight, or a prompt
    started that is neither trained nor in flight (lost). An empty list: the ledger holds."""
    problems = []
    if sorted(last) != list(range(1, steps + 1)):
        problems.append(f"versions {sorted(last)}, not 1..{steps} each once")
    short = {v: len(u) for v, u in sorted(last.items()) if len(u) != per_version}
    if short:
        problems.append(f"versions not trained on {per_version} prompts (version: prompts): {short}")
    uids = [u for v in sorted(last) for u in last[v]]
    twice = sorted(u for u, n in collections.Counter(uids).items() if n > 1)
    if twice:
        problems.append(f"prompts trained in more than one version: {twice}")
    if epoch is not None:
        epoch = set(epoch)
        if lost := sorted(epoch - set(uids)):
            problems.append(f"prompts of the epoch never trained: {lost}")
        if extra := sorted(set(uids) - epoch):
            problems.append(f"prompts trained from outside the epoch: {extra}")
    if started is not None:
        waiting = set(in_flight or ())
        if both := sorted(waiting & set(uids)):
            problems.append(f"prompts trained and still in flight: {both}")
        trained = len(set(uids))
        if trained + len(waiting) != started:
            problems.append(f"{started} prompts started, {trained} trained and {len(waiting)} in flight: "
                            f"{started - trained - len(waiting)} lost")  # fmt: skip
    return problems


def assert_each_prompt_trained_once(last: dict[int, list[str]], steps: int, per_version: int, **kw) -> None:
    """`ledger_problems` as an assertion (claim 3)."""
    problems = ledger_problems(last, steps, per_version, **kw)
    assert not problems, f"the ledger does not hold: {problems}; ledger: {last}"


def final_coordinator_state(workdir) -> dict:
    """The coordinator's state (`Coordinator.state()`: admission count, prompts in flight) in the run's
    newest checkpoint."""
    ckpt = os.path.join(workdir, "checkpoints")
    newest = max(int(d) for d in os.listdir(ckpt) if d.isdigit())
    with open(os.path.join(ckpt, str(newest), "coordinator", "metadata")) as f:  # orbax's JsonSave
        return json.load(f)


def staleness_problems(scalars: dict, eta: int, steps: int) -> list[str]:
    """What breaks the staleness bound in a run's TensorBoard scalars (`metrics.read_scalars`): every train
    step 1..steps logs `staleness/max` (head: trainer version - the version of a sample's first token) and
    `staleness/token_max` (per token), with token <= head <= eta at each step. An empty list: it holds."""
    head = dict(scalars.get("staleness/max", []))
    token = dict(scalars.get("staleness/token_max", []))
    problems = []
    if sorted(head) != list(range(1, steps + 1)) or sorted(token) != sorted(head):
        problems.append(f"steps logged: head {sorted(head)}, token {sorted(token)}; expected 1..{steps}")
    for step in sorted(set(head) & set(token)):
        if not token[step] <= head[step] <= eta:
            problems.append(f"step {step}: token staleness max {token[step]}, head max {head[step]}, "
                            f"eta {eta}")  # fmt: skip
    return problems


def assert_staleness_bound(scalars: dict, eta: int, steps: int) -> None:
    """`staleness_problems` as an assertion (claim 9)."""
    problems = staleness_problems(scalars, eta, steps)
    assert not problems, f"the staleness bound does not hold: {problems}"
