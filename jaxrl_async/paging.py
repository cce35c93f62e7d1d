"""Page arithmetic of the paged KV cache: the one rule that the sampler's page table
(`jaxrl_async.sampler.page_table`) and the performance model's batch cap (`jaxrl_async.perf.system`)
share. Plain Python, below both, so the analytic model never imports the sampler.

A sequence of prompt length p writes keys/values at positions 0 .. p + max_new - 2 (the last token is never
fed back). The group samples of one prompt share its full pages below position p - 1 by reference (the
position p - 1 is rewritten by each sample's first decode step, so the page holding it is private).
"""

from __future__ import annotations


def pages_for(positions: int, page_size: int) -> int:
    """Pages that hold `positions` consecutive positions from 0."""
    return -(-max(int(positions), 0) // page_size)


def shared_pages(prompt_len: int, page_size: int) -> int:
    """Full pages of a prompt that its group samples can share (every position below prompt_len - 1)."""
    return (prompt_len - 1) // page_size


def positions_after(prompt_len: int, max_new_tokens: int, calls: int, steps_per_call: int) -> int:
    """Positions a sequence has written by the end of its `calls`-th generate call (at most all it ever will).

    Insert leaves the prompt's last token to the first decode step, which writes position prompt_len - 1;
    every step writes one position and the last generated token is never written.
    """
    return min(prompt_len - 1 + calls * steps_per_call, prompt_len + max_new_tokens - 1)


def mean_resident_tokens(
    prompt_len: float,
    mean_len: float,
    mean_sq_len: float,
    page_size: int,
    group: int,
    steps_per_call: int,
) -> float:
    """Time-averaged KV tokens one running sequence holds under this module's rule (for capacity planning).

    A sequence of length L lives L steps holding prompt + t positions at step t, so averaged over running
    sequences the generated part is E[L^2] / (2 E[L]) (long sequences are running more of the time). Full
    prompt pages are shared by the `group` samples of a prompt; the rest of the prompt is private. Pages
    are allocated one call ahead (`steps_per_call` positions) and the last page is half empty on average.
    """
    shared = shared_pages(int(round(prompt_len)), page_size) * page_size
    private_prompt = prompt_len - shared
    generated = mean_sq_len / (2.0 * mean_len) if mean_len > 0 else 0.0
    return shared / max(group, 1) + private_prompt + generated + steps_per_call + page_size / 2.0
