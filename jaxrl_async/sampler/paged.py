"""Device side of the paged KV cache (SamplerConfig.attention="paged_kernel"): pool layout and shardings, page
writes, and decode attention through Pallas paged-attention kernels (JAX's, or `ragged_paged` on TPU).

Per layer one K and one V pool [G, data * pages_per_shard, page_size, K]: KV heads over "tensor" (when they
divide), pages over "data" (each data shard owns a contiguous range of pages and the slots that use them,
as the slotted cache splits its slots). Page tables hold shard-local page ids (`page_table.PageTable`), so
every function here runs inside `shard_map` on local blocks.

Kernels, all reading the [G, pages, page_size, K] pools directly (the first three from `pallas.ops`):
  - TPU: `tpu.paged_attention.paged_attention`. It reads K/V as bfloat16 whatever their dtype (its
    `MultiPageAsyncCopyDescriptor` casts them), so a float32 model on TPU decodes with rounded K/V.
  - GPU: `gpu.paged_attention.paged_attention` (Triton), in float32 when the cache is float32.
  - CPU: the GPU kernel in Pallas interpret mode (slow; tests and correctness checks only). The TPU
    kernel also runs in interpret mode (`pltpu.force_tpu_interpret_mode`), with its bfloat16 rounding.
  - TPU with SamplerConfig.paged_tpu_kernel="ragged": this repository's kernel (`ragged_paged`), which
    also writes each step's new K/V into the pools in place (DMA, pools aliased), where the default path
    scatters them with XLA first. Tested in interpret mode and lowered for tpu here, never run on a TPU.
    JAX's `tpu.ragged_paged_attention` does not run in interpret mode in jax 0.10.2 or 0.11.2 (head_dim
    below 128 fails a block-shape assertion; head_dim 128 fails in the interpreter: "'ReshapeTransform'
    object has no attribute 'indices'"), and its combined K|V page layout differs, so it is not used.
No kernel scales the scores: queries are multiplied by head_dim ** -0.5 first.

Static (recompiles): the layout (mesh, page_size, pages per shard, table width, kernel). Dynamic: page
tables, positions, pool contents.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxrl_async.sampler import ragged_paged
from jaxrl_async.sampler.config import MEGACORE
from jaxrl_async.sampler.layout import POOL_AXES
from jaxrl_async.sampler.page_table import SCRATCH, pages_for
from jaxrl_async.sharding import SAMPLER_RULES

IMPLS = ("tpu", "gpu")
TPU_KERNELS = ("paged", "ragged")  # values of SamplerConfig.paged_tpu_kernel
# Device kinds of the chips whose two TensorCores JAX presents as one device (jax's Pallas TPU chip table:
# v4 and v5p). The TPU kernel splits its grid over the two cores only when told, and its documentation
# warns that it may hang when told so on a chip without megacore.
MEGACORE_KINDS = ("TPU v4", "TPU v5", "TPU v5p")


def default_impl(platform: str) -> tuple[str, bool]:
    """(kernel, interpret) for a platform: the platform's own kernel, or the GPU kernel interpreted on CPU."""
    if platform == "tpu":
        return "tpu", False
    if platform in ("gpu", "cuda", "rocm"):
        return "gpu", False
    return "gpu", True


@dataclasses.dataclass(frozen=True)
class PagedLayout:
    """Static description of a paged cache on a mesh.

    Attributes:
      mesh: the sampler mesh ("data", "tensor").
      n_kv_heads, head_dim: of the model.
      page_size: positions per page.
      pages_per_shard: pages each data shard owns, its scratch page included.
      width: page-table columns per slot (pages of the longest sequence, rounded up for the kernel).
      impl: "tpu" or "gpu" (which Pallas kernel).
      interpret: run the kernel in Pallas interpret mode (CPU).
      megacore: how the TPU kernel splits its grid over a megacore chip's two TensorCores: "kv_head",
        "batch" or None (one core; `megacore_mode`).
      tpu_kernel: "paged" (JAX's `paged_attention` after an XLA scatter of the new K/V) or "ragged"
        (`ragged_paged`: our kernel, which writes the new K/V in place); TPU only.
    """

    mesh: Mesh
    n_kv_heads: int
    head_dim: int
    page_size: int
    pages_per_shard: int
    width: int
    impl: str
    interpret: bool
    megacore: str | None = None
    tpu_kernel: str = "paged"

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"paged kernel {self.impl!r} not in {IMPLS}")
        if self.tpu_kernel not in TPU_KERNELS or (self.tpu_kernel != "paged" and self.impl != "tpu"):
            raise ValueError(f"tpu_kernel={self.tpu_kernel!r} is a TPU kernel (one of {TPU_KERNELS})")
        if self.tpu_kernel == "ragged" and self.megacore == "batch":
            raise ValueError("the ragged TPU kernel splits over KV heads only, not megacore='batch'")
        if self.megacore is not None and self.impl != "tpu":
            raise ValueError(f"megacore={self.megacore!r} is a TPU kernel setting, not {self.impl!r}'s")

    @property
    def data(self) -> int:
        return self.mesh.shape["data"]

    @property
    def pool_shape(self) -> tuple[int, int, int, int]:
        return (self.n_kv_heads, self.data * self.pages_per_shard, self.page_size, self.head_dim)

    @property
    def heads(self) -> str | None:
        """Mesh axis of the KV heads (None: replicated, when "tensor" does not divide them)."""
        return SAMPLER_RULES.spec(("kv_heads",), (self.n_kv_heads,), self.mesh)[0]

    @property
    def pool_spec(self) -> PartitionSpec:
        return SAMPLER_RULES.spec(POOL_AXES, self.pool_shape, self.mesh)

    @property
    def blocks(self) -> tuple[int, int]:
        """(k_splits, pages per compute block) of the kernels, both dividing the table width.

        On a device, blocks of `KEYS_PER_BLOCK` positions (8 pages of 16, the kernels' own default), and for
        the GPU kernel up to 16 splits of a sequence's pages (its default; they parallelize one sequence at
        small batch). The table width (`table_width`) is a multiple of both, so neither shrinks with the
        sequence length: with the width merely a multiple of 16 pages, 8k-token sequences had run in 1-page
        (16-key) blocks. The TPU kernel does not split. In interpret mode (CPU) the grid is a Python loop:
        small splits, and blocks that divide whatever width a test builds."""
        per_block = pages_per_block(self.page_size)
        if not self.interpret:
            return (1 if self.impl == "tpu" else _splits(self.width, per_block)), per_block
        splits = 2
        while self.width % splits:
            splits //= 2
        while (self.width // splits) % per_block:
            per_block //= 2
        return splits, per_block


# Scalar memory of a TPU core, up to v6e: 1 MiB. The TPU paged kernel prefetches the whole call's page table
# (and the lengths) into it; vLLM-TPU keeps its block tables under half of it, the rest being the kernel's
# own (vllm-project/vllm#16871), after SMEM OOMs from this kernel at long contexts (#9350). Same bound here.
TPU_SMEM_BYTES = 1 << 20
SMEM_TABLE_SHARE = 0.5


def megacore_mode(setting: str, device_kind: str, local_kv_heads: int, local_slots: int) -> str | None:
    """The TPU kernel's `megacore_mode` for SamplerConfig.megacore = `setting` on devices of `device_kind`
    ("" when unknown: a program lowered here for a TPU target, or the interpreter).

    "auto" splits over KV heads where a shard's heads are even, else over its slots where they are even,
    on the megacore chips (`MEGACORE_KINDS`) only; anywhere else one core. "kv_head" or "batch" is used as
    given; it is refused on a TPU known to have no megacore (the kernel may hang there) and where the
    shard's heads (slots) are odd, naming the field.
    """
    if setting not in MEGACORE:
        raise ValueError(f"SamplerConfig.megacore={setting!r} not in {MEGACORE}")
    if setting == "off":
        return None
    if setting == "auto":
        if device_kind not in MEGACORE_KINDS:
            return None
        return "kv_head" if local_kv_heads % 2 == 0 else "batch" if local_slots % 2 == 0 else None
    if device_kind.startswith("TPU") and device_kind not in MEGACORE_KINDS:
        raise ValueError(
            f"SamplerConfig.megacore={setting!r}: {device_kind} has no megacore (one TensorCore a device); "
            'the kernel may hang. Use "auto" or "off"'
        )
    count, name = (local_kv_heads, "KV heads") if setting == "kv_head" else (local_slots, "slots")
    if count % 2:
        raise ValueError(
            f"SamplerConfig.megacore={setting!r} needs an even number of {name} per shard, not {count}"
        )
    return setting


def _device_kind(mesh: Mesh) -> str:
    """The TPU kind the engine runs on ("" off TPU). A megacore chip run with one device per TensorCore
    (a device with core_on_chip 1 exists) is no megacore device."""
    dev = mesh.devices.flat[0]
    if dev.platform != "tpu" or any(getattr(d, "core_on_chip", 0) for d in mesh.devices.flat):
        return ""
    return dev.device_kind


def table_smem_bytes(slots_per_shard: int, width: int, tpu_kernel: str = "paged") -> int:
    """Scalar-memory bytes of one TPU paged-kernel call's page table and lengths (int32): one data shard's
    slots x (table width + 1); the ragged kernel's also hold the query offsets and a decode step's write
    destinations (`ragged_paged.smem_bytes`)."""
    if tpu_kernel == "ragged":
        return ragged_paged.smem_bytes(slots_per_shard, width, slots_per_shard)
    return slots_per_shard * (width + 1) * 4


KEYS_PER_BLOCK = 128  # positions per compute block of both kernels on a device (one 128-key tile)
MAX_SPLITS = 16  # the GPU kernel's k_splits at most


def pages_per_block(page_size: int) -> int:
    """Pages per compute block: KEYS_PER_BLOCK positions (a larger page is a block of its own)."""
    return max(1, KEYS_PER_BLOCK // page_size)


def _splits(width: int, per_block: int) -> int:
    """The GPU kernel's k_splits for a table `width` (whole blocks): the most, up to MAX_SPLITS, that
    divide its blocks."""
    splits = MAX_SPLITS
    while (width // per_block) % splits:
        splits //= 2
    return splits


def table_width(pages_per_seq: int, page_size: int, impl: str, interpret: bool) -> int:
    """Page-table columns: pages of the longest sequence, rounded up so that the kernels' blocks divide
    them (`PagedLayout.blocks`). On a GPU that is whole blocks times the splits the sequence can use, so
    a 1,088-token sequence (68 pages of 16) gets 128 columns, 16 splits of one block (the splits past its
    length return at once), and a 4-page one 8 columns, one split."""
    per_block = pages_per_block(page_size)
    if interpret:
        multiple = 2
    elif impl == "tpu":
        multiple = per_block
    else:
        blocks = -(-pages_per_seq // per_block)
        multiple = per_block * min(MAX_SPLITS, 1 << (blocks.bit_length() - 1))
    return -(-pages_per_seq // multiple) * multiple


def engine_layout(mesh: Mesh, model_cfg, cfg) -> PagedLayout:
    """The page layout of an engine: `cfg.token_budget` split into pages over the data shards, each shard's
    scratch page added, on the kernel of ModelConfig.platform (when set: a program built here for another
    target) or of the mesh's devices.

    Raises:
      ValueError: a data shard gets too few pages for one sequence of max_prompt_len + max_new_tokens.
    """
    data = mesh.shape["data"]
    impl, interpret = default_impl(model_cfg.platform or mesh.devices.flat[0].platform)
    pages_per_seq = pages_for(cfg.max_seq_len, cfg.page_size)
    usable = cfg.token_budget // (data * cfg.page_size)
    if usable < pages_per_seq:
        raise ValueError(
            f"SamplerConfig.token_budget={cfg.token_budget} gives {usable} pages of {cfg.page_size} "
            f"positions per data shard ({data} shards); one sequence of max_prompt_len + "
            f"max_new_tokens = {cfg.max_seq_len} needs {pages_per_seq}"
        )
    if impl != "tpu" and cfg.paged_tpu_kernel != "paged":
        kernel = cfg.paged_tpu_kernel
        raise ValueError(f"SamplerConfig.paged_tpu_kernel={kernel!r}: a TPU kernel, not {impl}'s")
    width = table_width(pages_per_seq, cfg.page_size, impl, interpret)
    smem = table_smem_bytes(cfg.num_slots // data, width, cfg.paged_tpu_kernel)
    if impl == "tpu" and not interpret and smem > SMEM_TABLE_SHARE * TPU_SMEM_BYTES:
        raise ValueError(
            f"SamplerConfig.num_slots={cfg.num_slots} over {data} data shard(s) x {width} page-table columns "
            f"(max_prompt_len + max_new_tokens = {cfg.max_seq_len} in pages of page_size={cfg.page_size}) "
            f"is a {smem / 2**10:.0f} KiB page table per TPU kernel call, over {SMEM_TABLE_SHARE:.0%} of the "
            f"{TPU_SMEM_BYTES // 2**10} KiB of scalar memory; use fewer slots per data shard or larger pages"
        )
    layout = PagedLayout(
        mesh, model_cfg.n_kv_heads, model_cfg.head_dim, cfg.page_size, usable + 1, width, impl, interpret,
        tpu_kernel=cfg.paged_tpu_kernel,
    )  # fmt: skip
    if impl != "tpu":
        if cfg.megacore not in ("auto", "off"):
            raise ValueError(f"SamplerConfig.megacore={cfg.megacore!r}: a TPU kernel setting, not {impl}")
        return layout
    heads = layout.n_kv_heads // (mesh.shape[layout.heads] if layout.heads else 1)
    megacore = megacore_mode(cfg.megacore, _device_kind(mesh), heads, cfg.num_slots // data)
    if megacore == "batch" and layout.tpu_kernel == "ragged":
        if cfg.megacore == "batch":
            raise ValueError(
                "SamplerConfig.megacore='batch': the ragged TPU kernel (paged_tpu_kernel='ragged') splits "
                'over KV heads only; use "kv_head", "auto" or "off"'
            )
        megacore = None  # "auto" with odd heads a shard: one core, as "auto" does where nothing divides
    return dataclasses.replace(layout, megacore=megacore)


def _attend_local(layout: PagedLayout, q_BxHxK, kpool, vpool, lengths_B, table_BxW):
    """Paged decode attention on one shard's blocks (the Pallas kernel of `layout.impl`)."""
    from jax.experimental.pallas.ops.gpu import paged_attention as gpu_paged
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_paged

    q_BxHxK = (q_BxHxK.astype(jnp.float32) * layout.head_dim**-0.5).astype(kpool.dtype)
    splits, per_block = layout.blocks
    if layout.impl == "gpu":
        out = gpu_paged.paged_attention(
            q_BxHxK, kpool, vpool, table_BxW, lengths_B, block_h=16, pages_per_compute_block=per_block,
            k_splits=splits, interpret=layout.interpret,
        )  # fmt: skip
    else:
        from jax.experimental.pallas import tpu as pltpu

        # The interpreter runs a megacore split's core axis on two simulated cores; on one it hangs.
        cores = pltpu.InterpretParams(num_cores_or_threads=2 if layout.megacore else 1)
        interpret = pltpu.force_tpu_interpret_mode(cores) if layout.interpret else contextlib.nullcontext()
        with interpret:
            out = tpu_paged(
                q_BxHxK, kpool, vpool, lengths_B, table_BxW, pages_per_compute_block=per_block,
                megacore_mode=layout.megacore,
            )  # fmt: skip
    return out


def _specs(layout: PagedLayout):
    rows = PartitionSpec("data")
    return rows, PartitionSpec("data", layout.heads, None), layout.pool_spec


def write_and_attend(layout: PagedLayout, q_BxHxK, k_BxGxK, v_BxGxK, kpool, vpool, table_BxW, pos_B, done_B):
    """Writes each live row's key/value at its position's page, then attends to positions <= it.

    Rows that are `done` write to the scratch page (their pages may already belong to another sequence).

    Returns:
      (attention [B, H, K] in q's dtype, kpool, vpool).
    """
    ps = layout.page_size

    def body(q, k, v, kp, vp, table, pos, done):
        page_B = jnp.take_along_axis(table, (pos // ps)[:, None], axis=1)[:, 0]
        page_B = jnp.where(done, SCRATCH, page_B)
        if layout.tpu_kernel == "ragged":  # one query token a row; the kernel writes the row in place
            scaled = q.astype(jnp.float32) * layout.head_dim**-0.5
            cu_q = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)
            out, kp, vp = ragged_paged.ragged_paged_attention(
                scaled, k, v, kp, vp, cu_q, pos + 1, table, page_B * ps + pos % ps,
                pages_per_block=layout.blocks[1], megacore=layout.megacore, interpret=layout.interpret,
            )  # fmt: skip
            return out.astype(q.dtype), kp, vp
        kp = kp.at[:, page_B, pos % ps].set(k.transpose(1, 0, 2).astype(kp.dtype))
        vp = vp.at[:, page_B, pos % ps].set(v.transpose(1, 0, 2).astype(vp.dtype))
        out = _attend_local(layout, q, kp, vp, pos + 1, table)
        return out.astype(q.dtype), kp, vp

    rows, heads3, pool = _specs(layout)
    table_spec = PartitionSpec("data", None)
    fn = jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=(heads3, heads3, heads3, pool, pool, table_spec, rows, rows),
        out_specs=(heads3, pool, pool),
        check_vma=False,
    )
    return fn(q_BxHxK, k_BxGxK, v_BxGxK, kpool, vpool, table_BxW, pos_B, done_B)


def _chunks(x_NxGxTxK, page_size: int, n_chunks: int):
    """[N, G, T, K] -> [G, N, n_chunks, page_size, K] (T padded with zeros to n_chunks * page_size)."""
    n, g, t, k = x_NxGxTxK.shape
    x = jnp.pad(x_NxGxTxK, ((0, 0), (0, 0), (0, n_chunks * page_size - t), (0, 0)))
    return x.reshape(n, g, n_chunks, page_size, k).transpose(1, 0, 2, 3, 4)


def write_prefix(layout: PagedLayout, kpool, vpool, keys_NxGxTxK, values_NxGxTxK, src, dest_DxC):
    """Copies prompt chunk c of prefix row `src` into page dest[d, c] of data shard d (SCRATCH: skipped).

    Only the shard that owns the slot has non-scratch entries; chunks whose pages another sample of the
    group already wrote are SCRATCH too.
    """

    def body(kp, vp, pk, pv, src, dest):
        n_chunks = dest.shape[1]
        pick = lambda x: jax.lax.dynamic_slice_in_dim(x, src, 1, axis=0)
        kc = _chunks(pick(pk), layout.page_size, n_chunks)[:, 0]  # [G, C, ps, K]
        vc = _chunks(pick(pv), layout.page_size, n_chunks)[:, 0]
        kp = kp.at[:, dest[0]].set(kc.astype(kp.dtype))
        vp = vp.at[:, dest[0]].set(vc.astype(vp.dtype))
        return kp, vp

    pool = layout.pool_spec
    prefix = PartitionSpec(None, layout.heads, None, None)
    fn = jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=(pool, pool, prefix, prefix, PartitionSpec(), PartitionSpec("data", None)),
        out_specs=(pool, pool),
        check_vma=False,
    )
    return fn(kpool, vpool, keys_NxGxTxK, values_NxGxTxK, src, dest_DxC)


def write_sequences(layout: PagedLayout, kpool, vpool, keys_BxGxTxK, values_BxGxTxK, dest_BxC):
    """Writes slot b's positions [c * page_size, (c + 1) * page_size) into page dest[b, c] (recompute_kv)."""

    def body(kp, vp, k, v, dest):
        n_chunks = dest.shape[1]
        kp = kp.at[:, dest].set(_chunks(k, layout.page_size, n_chunks).astype(kp.dtype))
        vp = vp.at[:, dest].set(_chunks(v, layout.page_size, n_chunks).astype(vp.dtype))
        return kp, vp

    pool = layout.pool_spec
    seqs = PartitionSpec("data", layout.heads, None, None)
    fn = jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=(pool, pool, seqs, seqs, PartitionSpec("data", None)),
        out_specs=(pool, pool),
        check_vma=False,
    )
    return fn(kpool, vpool, keys_BxGxTxK, values_BxGxTxK, dest_BxC)


def reference_attention(q_BxHxK, kpool, vpool, lengths_B, table_BxW):
    """XLA reference of the paged attention on one shard (tests): gathers every slot's pages, masks."""
    g, _, _, kd = kpool.shape
    b, h, _ = q_BxHxK.shape
    k_BxGxSxK = kpool[:, table_BxW].transpose(1, 0, 2, 3, 4).reshape(b, g, -1, kd).astype(jnp.float32)
    v_BxGxSxK = vpool[:, table_BxW].transpose(1, 0, 2, 3, 4).reshape(b, g, -1, kd).astype(jnp.float32)
    q_BxGxRxK = q_BxHxK.reshape(b, g, h // g, kd).astype(jnp.float32)
    s_BxGxRxS = jnp.einsum("bgrk,bgsk->bgrs", q_BxGxRxK, k_BxGxSxK) * kd**-0.5
    mask_BxS = jnp.arange(s_BxGxRxS.shape[-1])[None, :] < lengths_B[:, None]
    s_BxGxRxS = jnp.where(mask_BxS[:, None, None], s_BxGxRxS, -1e30)
    out = jnp.einsum("bgrs,bgsk->bgrk", jax.nn.softmax(s_BxGxRxS, -1), v_BxGxSxK)
    return out.reshape(b, h, kd)
