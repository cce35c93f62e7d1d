"""Decode-step kernels as XLA:CPU custom calls (`SamplerConfig.attention` / `.linear` = "cpu_kernel").

Attention: XLA:CPU computes the decode step's attention (batched matrix-vector products over every
slot's whole cache row) on a single thread at ~10 GB/s; at batch 32 on llama_100m that was 45 of 106 ms
per step. The kernel reads only each slot's valid positions and splits the (slot, KV head) rows over
threads.
Linear: at batch 1 the weight matrix-vector products are the whole step, and XLA:CPU's stream the
weights at ~80% of the read bandwidth; at batch 4-32 its dots with few rows are far from peak. The kernel
takes weights packed in panels of 16 output rows (`pack`, done once per weight update), so each panel is
one sequential stream and every weight load feeds up to 28 multiply-adds.

`kernels/decode_kernels.cc` is compiled with the system C++ compiler on first use into a per-user cache
keyed by the source and jaxlib version, then registered with `jax.ffi`. CPU only, one sampler device (the
custom calls have no partitioning rule); the engine checks both.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

_TARGETS = {"DecodeAttention": "jaxrl_async_decode_attention", "Linear": "jaxrl_async_linear"}
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels", "decode_kernels.cc")
PANEL = 16  # output rows per packed weight panel (the kernel's vector width)


def _cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "jaxrl_async", "kernels")


def _build(source: str, out: str) -> None:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError(
            "SamplerConfig attention/linear='cpu_kernel' needs a C++ compiler (g++ or $CXX) to build "
            f"{os.path.basename(source)}; install one or use 'xla'"
        )
    with tempfile.NamedTemporaryFile(suffix=".so", dir=os.path.dirname(out), delete=False) as f:
        tmp = f.name
    cmd = [
        cxx, "-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-std=c++17", "-shared",
        "-fPIC", "-w", f"-I{jax.ffi.include_dir()}", source, "-o", tmp, "-lpthread",
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"building {source} failed:\n{' '.join(cmd)}\n{res.stderr[-2000:]}")
    os.replace(tmp, out)  # atomic: concurrent builders never load a half-written library


@functools.cache
def load() -> dict[str, str]:
    """Builds (once per source/jaxlib version) and registers the kernels; returns {symbol: FFI target}."""
    import jaxlib

    with open(_SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read() + jaxlib.__version__.encode()).hexdigest()[:16]
    cache = _cache_dir()
    try:
        os.makedirs(cache, exist_ok=True)
    except OSError:  # read-only home: build next to the other temporary files instead
        cache = os.path.join(tempfile.gettempdir(), "jaxrl_async_kernels")
        os.makedirs(cache, exist_ok=True)
    path = os.path.join(cache, f"decode_kernels_{digest}.so")
    if not os.path.exists(path):
        _build(_SOURCE, path)
    lib = ctypes.cdll.LoadLibrary(path)
    for symbol, target in _TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return _TARGETS


def default_threads() -> int:
    """Cores this process may use (the kernels' pool size; the first call in a process fixes it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def decode_attention(q_BxGxRxK, k_BxGxSxK, v_BxGxSxK, n_valid_B, threads: int | None = None):
    """softmax(q k^T / sqrt(K)) v over positions < n_valid[b] of each slot (float32; see module doc)."""
    call = jax.ffi.ffi_call(load()["DecodeAttention"], jax.ShapeDtypeStruct(q_BxGxRxK.shape, jnp.float32))
    scale = np.float32(q_BxGxRxK.shape[-1] ** -0.5)
    return call(
        q_BxGxRxK.astype(jnp.float32),
        k_BxGxSxK.astype(jnp.float32),
        v_BxGxSxK.astype(jnp.float32),
        n_valid_B.astype(jnp.int32),
        scale=scale,
        threads=np.int64(threads or default_threads()),
    )


def pack(w_NxD):
    """[N, D] output-major weight -> [N / 16, D, 16] panels for `linear` (N must be a multiple of 16)."""
    n, d = w_NxD.shape
    if n % PANEL:
        raise ValueError(f"pack needs a multiple of {PANEL} output rows, got {n}")
    return w_NxD.reshape(n // PANEL, PANEL, d).transpose(0, 2, 1)


def linear(x_MxD, w_PxDx16, threads: int | None = None):
    """x @ w.T in float32 for a weight packed by `pack` (any number of rows M)."""
    out = jax.ShapeDtypeStruct((x_MxD.shape[0], w_PxDx16.shape[0] * PANEL), jnp.float32)
    call = jax.ffi.ffi_call(load()["Linear"], out)
    threads = np.int64(threads or default_threads())
    return call(x_MxD.astype(jnp.float32), w_PxDx16.astype(jnp.float32), threads=threads)
