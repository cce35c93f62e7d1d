"""Decode-step kernels as XLA:CPU custom calls (`SamplerConfig.attention` / `.linear` = "cpu_kernel").

Attention: XLA:CPU computes the decode step's attention (batched matrix-vector products over every
slot's whole cache row) on a single thread at ~10 GB/s; at batch 32 on llama_100m that was 45 of 106 ms
per step. The kernel reads only each slot's valid positions and splits the (slot, KV head) rows over
threads.
Linear: at batch 1 the weight matrix-vector products are the whole step, and XLA:CPU's stream the
weights at ~80% of the read bandwidth; at batch 4-32 its dots with few rows are far from peak. The kernel
takes weights packed in panels of 16 output rows (`pack`, done once per weight update), so each panel is
one sequential stream and every weight load feeds several multiply-adds (the register blocking follows
the instruction set the library is compiled for: 14 rows x 2 panels with AVX-512, 6 x 1 with AVX2).

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
MARCH_ENV = "JAXRL_ASYNC_KERNEL_MARCH"  # -march for the kernel library (default "native")


def _cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "jaxrl_async", "kernels")


def _march(march: str | None) -> str:
    return march or os.environ.get(MARCH_ENV) or "native"


def _build(source: str, out: str, march: str) -> None:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError(
            "SamplerConfig attention/linear='cpu_kernel' needs a C++ compiler (g++ or $CXX) to build "
            f"{os.path.basename(source)}; install one or use 'xla'"
        )
    with tempfile.NamedTemporaryFile(suffix=".so", dir=os.path.dirname(out), delete=False) as f:
        tmp = f.name
    cmd = [
        cxx, "-O3", f"-march={march}", "-ffast-math", "-fopenmp-simd", "-std=c++17", "-shared",
        "-fPIC", "-w", f"-I{jax.ffi.include_dir()}", source, "-o", tmp, "-lpthread",
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"building {source} failed:\n{' '.join(cmd)}\n{res.stderr[-2000:]}")
    os.replace(tmp, out)  # atomic: concurrent builders never load a half-written library


def compiler_available() -> bool:
    """Whether a C++ compiler is there to build the kernels ($CXX, g++ or c++)."""
    return bool(os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++"))


@functools.cache
def _library(march: str) -> ctypes.CDLL:
    import jaxlib

    with open(_SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read() + jaxlib.__version__.encode() + march.encode()).hexdigest()[:16]
    cache = _cache_dir()
    try:
        os.makedirs(cache, exist_ok=True)
    except OSError:  # read-only home: build next to the other temporary files instead
        cache = os.path.join(tempfile.gettempdir(), "jaxrl_async_kernels")
        os.makedirs(cache, exist_ok=True)
    path = os.path.join(cache, f"decode_kernels_{digest}.so")
    if not os.path.exists(path):
        _build(_SOURCE, path, march)
    return ctypes.cdll.LoadLibrary(path)


@functools.cache
def load(march: str | None = None) -> dict[str, str]:
    """Builds (once per source, jaxlib version and -march) and registers the kernels.

    Args:
      march: the compiler's -march (default: $JAXRL_ASYNC_KERNEL_MARCH or "native"). Another value builds a
        second library whose targets carry it in their names, e.g. "x86-64-v3" (AVX2) to check on an
        AVX-512 machine the blocking an AVX2 machine gets.

    Returns:
      {symbol: FFI target name}.
    """
    march = _march(march)
    lib = _library(march)
    suffix = "" if march == "native" else "_" + march.replace("-", "_")
    targets = {symbol: target + suffix for symbol, target in _TARGETS.items()}
    for symbol, target in targets.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return targets


def kernel_info(march: str | None = None) -> str:
    """The instruction set and linear-kernel blocking the library was compiled for, e.g. "avx512 14x2"."""
    fn = _library(_march(march)).KernelInfo
    fn.restype = ctypes.c_char_p
    return fn().decode()


def default_threads() -> int:
    """Cores this process may use (the kernels' pool size; the first call in a process fixes it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def decode_attention(
    q_BxGxRxK, k_BxGxSxK, v_BxGxSxK, n_valid_B, threads: int | None = None, march: str | None = None
):
    """softmax(q k^T / sqrt(K)) v over positions < n_valid[b] of each slot (float32; see module doc)."""
    call = jax.ffi.ffi_call(
        load(march)["DecodeAttention"], jax.ShapeDtypeStruct(q_BxGxRxK.shape, jnp.float32)
    )
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


def linear(x_MxD, w_PxDx16, threads: int | None = None, march: str | None = None):
    """x @ w.T in float32 for a weight packed by `pack` (any number of rows M)."""
    out = jax.ShapeDtypeStruct((x_MxD.shape[0], w_PxDx16.shape[0] * PANEL), jnp.float32)
    call = jax.ffi.ffi_call(load(march)["Linear"], out)
    threads = np.int64(threads or default_threads())
    return call(x_MxD.astype(jnp.float32), w_PxDx16.astype(jnp.float32), threads=threads)
