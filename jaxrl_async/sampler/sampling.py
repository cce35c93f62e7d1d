"""Token sampling: greedy, temperature, top-k, top-p, with per-row keys and trainer-consistent logprobs.

Randomness: the token at absolute position p of a sequence is drawn with `fold_in(row_key, p)`, and a row
key depends only on the request's seed and sample index, so a sequence never depends on its slot or on
the rest of the batch.

Logprobs: `logprobs` is `token_logprobs(logits, token, temperature)` — log softmax(logits / T) over the
full vocabulary — exactly what the trainer computes for the same weights. When top-k / top-p truncation is
active the token was actually drawn from the truncated, renormalised distribution; its log-probability
under that distribution is returned separately as `sample_logprobs` (equal to `logprobs` without
truncation). Greedy decoding reports logprobs at temperature 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_async.model import token_logprobs

_NEG_INF = -1e30
_CHUNK = 128  # inverse-CDF sampling: pick a chunk of the vocabulary, then a token inside it


def row_keys(seeds_B, sample_index_B):
    """Raw uint32 key data [B, 2] for (seed, sample index) pairs."""
    make = lambda s, i: jax.random.key_data(jax.random.fold_in(jax.random.key(s), i))
    return jax.vmap(make)(jnp.asarray(seeds_B, jnp.uint32), jnp.asarray(sample_index_B, jnp.uint32))


def uniforms(key_data_Bx2, positions_B):
    """One uniform in (0, 1] per row, from the row's key folded with the token's absolute position."""
    draw = lambda kd, p: jax.random.uniform(jax.random.fold_in(jax.random.wrap_key_data(kd), p))
    return 1.0 - jax.vmap(draw)(key_data_Bx2, positions_B.astype(jnp.uint32))


def top_k_mask(logits_BxV, k: int):
    """Keeps each row's k largest logits (ties at the k-th value are kept), the rest set to -inf."""
    kth_B = jax.lax.top_k(logits_BxV, k)[0][:, -1]
    return jnp.where(logits_BxV >= kth_B[:, None], logits_BxV, _NEG_INF)


def _nucleus_threshold_bisect(probs_BxV, p: float, iters: int = 40):
    """Largest probability threshold whose kept mass (probs >= threshold) is still >= p (bisection)."""

    def body(_, lo_hi):
        lo, hi = lo_hi
        mid = 0.5 * (lo + hi)
        mass = jnp.sum(jnp.where(probs_BxV >= mid[:, None], probs_BxV, 0.0), axis=-1)
        ok = mass >= p
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    b = probs_BxV.shape[0]
    lo, _ = jax.lax.fori_loop(0, iters, body, (jnp.zeros((b,)), jnp.max(probs_BxV, -1) * (1 + 1e-6)))
    return lo


def top_p_mask(logits_BxV, p: float, candidates: int):
    """Keeps the smallest set of most likely tokens whose probability reaches p; the rest set to -inf.

    Looks among the `candidates` best tokens first and runs an exact full-vocabulary threshold bisection
    only when some row's nucleus is larger than that.
    """
    probs_BxV = jax.nn.softmax(logits_BxV, axis=-1)
    c = min(candidates, logits_BxV.shape[-1])
    top_BxC, _ = jax.lax.top_k(probs_BxV, c)
    before_BxC = jnp.cumsum(top_BxC, axis=-1) - top_BxC
    n_keep_B = jnp.maximum(jnp.sum(before_BxC < p, axis=-1), 1)
    thresh_B = jnp.take_along_axis(top_BxC, (n_keep_B - 1)[:, None], axis=-1)[:, 0]
    fits_B = jnp.sum(top_BxC, axis=-1) >= p
    thresh_B = jax.lax.cond(
        jnp.all(fits_B),
        lambda: thresh_B,
        lambda: jnp.where(fits_B, thresh_B, _nucleus_threshold_bisect(probs_BxV, p)),
    )
    return jnp.where(probs_BxV >= thresh_B[:, None], logits_BxV, _NEG_INF)


def inverse_cdf(weights_BxV, u_B):
    """Index i with cum[i-1] < u * total <= cum[i] for non-negative weights: an exact categorical draw.

    Two levels (vocabulary chunks, then tokens in the chunk) keep the cumulative sums short.
    """
    b, v = weights_BxV.shape
    n = -(-v // _CHUNK)
    w_BxNxC = jnp.pad(weights_BxV, ((0, 0), (0, n * _CHUNK - v))).reshape(b, n, _CHUNK)
    chunk_tot_BxN = jnp.sum(w_BxNxC, axis=-1)
    chunk_cum_BxN = jnp.cumsum(chunk_tot_BxN, axis=-1)
    target_B = u_B * chunk_cum_BxN[:, -1]
    chunk_B = jnp.minimum(jnp.sum(chunk_cum_BxN < target_B[:, None], axis=-1), n - 1)
    rows = jnp.arange(b)
    before_B = chunk_cum_BxN[rows, chunk_B] - chunk_tot_BxN[rows, chunk_B]
    w_BxC = w_BxNxC[rows, chunk_B]
    cum_BxC = jnp.cumsum(w_BxC, axis=-1)
    # Rounding may push the residual past the chunk's total: fall back to its last non-zero weight.
    last_nz_B = _CHUNK - 1 - jnp.argmax((w_BxC > 0)[:, ::-1], axis=-1)
    inner_B = jnp.minimum(jnp.sum(cum_BxC < (target_B - before_B)[:, None], axis=-1), last_nz_B)
    return (chunk_B * _CHUNK + inner_B).astype(jnp.int32)


def sample(
    logits_BxV,
    key_data_Bx2,
    positions_B,
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    top_p_candidates: int = 256,
):
    """Draws one token per row.

    Args:
      logits_BxV: float32 logits.
      key_data_Bx2: uint32 raw row keys (`row_keys`).
      positions_B: absolute position the drawn token will occupy (folded into the key).
      temperature: 0 = greedy; top_k (0 = off), top_p (1 = off): truncation of the tempered distribution.

    Returns:
      (tokens_B int32, logprobs_B: log softmax(logits / T)[token] (T = 1 when greedy; the trainer's value),
       sample_logprobs_B: log-probability under the truncated distribution actually sampled from).
    """
    logits_BxV = logits_BxV.astype(jnp.float32)
    if temperature == 0.0:
        tokens_B = jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
        logp_B = token_logprobs(logits_BxV[:, None], tokens_B[:, None], 1.0)[0][:, 0]
        return tokens_B, logp_B, jnp.zeros_like(logp_B)
    scaled_BxV = logits_BxV / temperature
    if top_k > 0 and top_k < logits_BxV.shape[-1]:
        scaled_BxV = top_k_mask(scaled_BxV, top_k)
    if top_p < 1.0:
        scaled_BxV = top_p_mask(scaled_BxV, top_p, top_p_candidates)
    logz_B = jax.nn.logsumexp(scaled_BxV, axis=-1)
    weights_BxV = jnp.exp(scaled_BxV - logz_B[:, None])
    tokens_B = inverse_cdf(weights_BxV, uniforms(key_data_Bx2, positions_B))
    sample_logp_B = jnp.take_along_axis(scaled_BxV, tokens_B[:, None], axis=-1)[:, 0] - logz_B
    logp_B = token_logprobs(logits_BxV[:, None], tokens_B[:, None], temperature)[0][:, 0]
    return tokens_B, logp_B, sample_logp_B
