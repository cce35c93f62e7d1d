"""Sampler configuration: slots, KV budget, buckets, sampling method, kernels and the weight-update mode."""

from __future__ import annotations

import dataclasses

ATTENTION = ("auto", "xla", "paged_kernel", "cpu_kernel")  # values of SamplerConfig.attention
LINEAR = ("auto", "xla", "cpu_kernel")  # values of SamplerConfig.linear
UPDATE_MODES = ("keep_kv", "recompute_kv", "finish")
MEGACORE = ("auto", "kv_head", "batch", "off")  # values of SamplerConfig.megacore (sampler/paged.py)
PAGED_TPU_KERNELS = ("paged", "ragged")  # values of SamplerConfig.paged_tpu_kernel (sampler/paged.py)
LORA_APPLY = ("merge", "unmerged")  # values of SamplerConfig.lora_apply


def default_buckets(max_len: int, smallest: int = 16) -> tuple[int, ...]:
    """Powers of two from `smallest` up to (and always ending with) `max_len`."""
    out, b = [], smallest
    while b < max_len:
        out.append(b)
        b *= 2
    return (*out, max_len)


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """Static settings of one sampler engine; every field is static (changing one recompiles).

    Attributes:
      num_slots: decode batch size (sequences decoded together); a multiple of the mesh's data axis. With
        the paged cache it is the most sequences that may run at once; free pages decide how many do.
      max_prompt_len: longest prompt accepted (the largest prompt bucket).
      max_new_tokens: most tokens generated per sequence (a request may ask for fewer).
      token_budget: KV-cache capacity in tokens over all slots. Slotted cache: each slot holds
        token_budget // num_slots positions. Paged cache: the page pool, split evenly over the data axis
        (each data shard also keeps one scratch page). None = num_slots * (max_prompt_len + max_new_tokens),
        so every request fits; with the paged cache each sequence's length is rounded up to whole pages, so
        that it never runs out of pages.
      prompt_buckets: prompt lengths are padded up to one of these (one prefill compilation each).
      prefill_batch: at most this many prompts (of one bucket) are prefilled in one call when several
        are admitted at once; batches are padded to a power of two (all compiled on a bucket's first use).
      steps_per_call: decode steps per compiled `generate` call (`lax.scan`); the host parses round k
        while round k + 1 runs.
      temperature: sampling temperature; 0 = greedy. Logprobs use the same temperature (1.0 when greedy).
      top_k: keep the k most likely tokens (0 = off).
      top_p: nucleus sampling mass (1.0 = off).
      top_p_candidates: top-p first looks among this many best tokens and falls back to an exact
        full-vocabulary threshold search only when their mass is below top_p (a speed knob only).
      stop_tokens: token ids that end a sequence (included in the completion).
      update_mode: default weight-update mode: "keep_kv", "recompute_kv" or "finish".
      overlap_host: parse round k's tokens while round k + 1 runs (only round k's done flags are read
        before admitting, so finished slots still refill for round k + 1); False reads each round back in
        full before the next is dispatched.
      fuse_projections: decode with fused q|k|v and gate|up weights (fewer, larger matmuls; not with
        linear="cpu_kernel", where separate matrices measured faster).
      attention: decode attention. "xla": einsums over a slotted cache (any backend). "cpu_kernel": a C++
        custom call for XLA:CPU that reads only valid positions on all cores (one sampler device, float32,
        needs a C++ compiler). "paged_kernel": a paged KV cache (`page_size` positions per page, page tables
        per slot, shared prompt pages) read by the JAX Pallas paged-attention kernel of the platform (TPU and
        GPU; on CPU the GPU kernel in Pallas interpret mode, for tests only: slow). "auto": paged_kernel on
        TPU and GPU; on one float32 CPU device whichever of xla and cpu_kernel (with `linear`) decoded
        fastest when the engine was built (timed, see docs/sampler.md); otherwise xla.
      linear: sampler matmuls: "xla" (dots), "cpu_kernel" (a C++ custom call for XLA:CPU over weights packed
        in 16-row panels at each weight update; all cores; same limits as attention="cpu_kernel") or "auto"
        (timed with `attention` on one float32 CPU device, else xla).
      page_size: KV positions per page of the paged cache (attention="paged_kernel").
      megacore: how the TPU paged kernel uses a megacore chip's two TensorCores (v4, v5p): "auto" (split
        over KV heads where a shard's are even, else over slots; one core on other chips), "kv_head",
        "batch" or "off" (one core). Read by the TPU kernel only (`paged.megacore_mode`).
      paged_tpu_kernel: the TPU decode kernel of the paged cache: "paged" (JAX's `paged_attention`, the new
        K/V written first by an XLA scatter into the donated pools) or "ragged" (`sampler/ragged_paged.py`,
        this repository's Pallas kernel: writes the new K/V into the pools in place by DMA, then attends; K/V
        read in their own dtype; megacore over KV heads only). "paged" stays the default until a TPU times
        both: "ragged" is tested in interpret mode and lowered for tpu here, never run on a TPU. Refused off
        TPU and with a slotted cache.
      lora_apply: how a LoRA run's (config.trainer.lora) sampler applies each version's adapters:
        "merge" writes W + (alpha/r)·A·B into its copy of the base once per version; "unmerged" keeps the
        base's decode layout and adds (x·A)·B in every matmul, so a version lays out only the adapters.
        docs/sampler.md has the measurements behind the default. Not read without LoRA.
    """

    num_slots: int = 8
    max_prompt_len: int = 128
    max_new_tokens: int = 128
    token_budget: int | None = None
    prompt_buckets: tuple[int, ...] | None = None
    prefill_batch: int = 4
    steps_per_call: int = 8
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    top_p_candidates: int = 256
    stop_tokens: tuple[int, ...] = ()
    update_mode: str = "keep_kv"
    overlap_host: bool = True
    fuse_projections: bool = True
    attention: str = "auto"
    linear: str = "auto"
    page_size: int = 16
    megacore: str = "auto"
    paged_tpu_kernel: str = "paged"
    lora_apply: str = "unmerged"

    def __post_init__(self):
        positive = ("num_slots", "max_prompt_len", "max_new_tokens", "steps_per_call", "top_p_candidates")
        positive += ("page_size",)
        for name in (*positive, "prefill_batch"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"SamplerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.prompt_buckets is None:
            object.__setattr__(self, "prompt_buckets", default_buckets(self.max_prompt_len))
        buckets = tuple(int(b) for b in self.prompt_buckets)
        object.__setattr__(self, "prompt_buckets", buckets)
        if list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(
                f"SamplerConfig.prompt_buckets must be strictly increasing and >= 1, got {buckets}"
            )
        if buckets[-1] != self.max_prompt_len:
            raise ValueError(
                f"SamplerConfig.prompt_buckets must end with max_prompt_len={self.max_prompt_len}, "
                f"got {buckets}"
            )
        if self.token_budget is None:  # every sequence in whole pages with the paged cache (module doc)
            ps = self.page_size if self.attention == "paged_kernel" else 1
            object.__setattr__(self, "token_budget", self.num_slots * -(-self.max_seq_len // ps) * ps)
        if self.attention in ("xla", "cpu_kernel"):  # the slotted cache ("auto": checked by the engine)
            self.check_slotted()
        if self.token_budget < self.max_prompt_len + 1:
            raise ValueError(
                f"SamplerConfig.token_budget={self.token_budget} cannot hold one prompt of max_prompt_len="
                f"{self.max_prompt_len} (+ 1)"
            )
        if self.temperature < 0:
            raise ValueError(f"SamplerConfig.temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"SamplerConfig.top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplerConfig.top_p must be in (0, 1], got {self.top_p}")
        if self.update_mode not in UPDATE_MODES:
            raise ValueError(f"SamplerConfig.update_mode={self.update_mode!r} not in {UPDATE_MODES}")
        for name, allowed in (("attention", ATTENTION), ("linear", LINEAR)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"SamplerConfig.{name}={getattr(self, name)!r} not in {allowed}")
        if self.megacore not in MEGACORE:
            raise ValueError(f"SamplerConfig.megacore={self.megacore!r} not in {MEGACORE}")
        if self.paged_tpu_kernel not in PAGED_TPU_KERNELS:
            raise ValueError(
                f"SamplerConfig.paged_tpu_kernel={self.paged_tpu_kernel!r} not in {PAGED_TPU_KERNELS}"
            )
        if self.lora_apply not in LORA_APPLY:
            raise ValueError(f"SamplerConfig.lora_apply={self.lora_apply!r} not in {LORA_APPLY}")
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))
        self._refuse_unread()

    def with_kernels(self, attention: str, linear: str) -> SamplerConfig:
        """This config with its "auto" kernels resolved. A budget of every slot at full length (the
        default's) stays that in whole pages when the cache turns out paged (`"auto"` on TPU and GPU)."""
        full = self.token_budget == self.num_slots * self.max_seq_len
        budget = None if full and attention == "paged_kernel" else self.token_budget
        return dataclasses.replace(self, attention=attention, linear=linear, token_budget=budget)

    def _refuse_unread(self) -> None:
        """A knob set away from its default that this configuration never reads is an error."""
        default = {f.name: f.default for f in dataclasses.fields(SamplerConfig)}
        if self.temperature == 0 and (self.top_k or self.top_p < 1.0):
            raise ValueError(
                f"SamplerConfig.top_k={self.top_k} / top_p={self.top_p} have no effect with temperature=0 "
                "(greedy decoding)"
            )
        if self.top_p == 1.0 and self.top_p_candidates != default["top_p_candidates"]:
            raise ValueError("SamplerConfig.top_p_candidates has no effect with top_p=1.0 (no nucleus)")
        for name in ("page_size", "megacore", "paged_tpu_kernel"):
            if self.attention in ("xla", "cpu_kernel") and getattr(self, name) != default[name]:
                raise ValueError(
                    f"SamplerConfig.{name} has no effect with attention={self.attention!r} (a slotted cache)"
                )

    def check_slotted(self) -> None:
        """Raises ValueError unless every slot of a slotted cache can hold a prompt of max_prompt_len."""
        if self.slot_len < self.max_prompt_len + 1:
            raise ValueError(
                f"SamplerConfig.token_budget={self.token_budget} gives {self.slot_len} positions per slot "
                f"over {self.num_slots} slots; need >= max_prompt_len + 1 = {self.max_prompt_len + 1}"
            )

    @property
    def slot_len(self) -> int:
        """KV positions per slot of the slotted cache (prompt + generated tokens must fit)."""
        return self.token_budget // self.num_slots

    @property
    def max_seq_len(self) -> int:
        """Longest sequence a request can make: max_prompt_len + max_new_tokens."""
        return self.max_prompt_len + self.max_new_tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def logprob_temperature(self) -> float:
        """Temperature of the reported logprobs: the sampling temperature, or 1.0 when greedy."""
        return 1.0 if self.greedy else self.temperature

    def prompt_bucket(self, prompt_len: int) -> int:
        """The smallest prompt bucket >= prompt_len.

        Raises:
          ValueError: the prompt is longer than max_prompt_len.
        """
        for b in self.prompt_buckets:
            if prompt_len <= b:
                return b
        raise ValueError(f"prompt of {prompt_len} tokens exceeds max_prompt_len={self.max_prompt_len}")

    def recompute_bucket(self, length: int, capacity: int | None = None) -> int:
        """Length bucket for re-prefilling every slot after a `recompute_kv` weight update.

        Args:
          capacity: the longest sequence the cache holds (default: the slotted cache's slot_len).
        """
        capacity = self.slot_len if capacity is None else capacity
        for b in (*self.prompt_buckets, *default_buckets(capacity, self.max_prompt_len)):
            if length <= b:
                return b
        raise ValueError(f"sequence of {length} tokens exceeds the sequence capacity {capacity}")

    @property
    def cpu_kernels(self) -> tuple[str, ...]:
        """Names of the fields that explicitly select a CPU kernel (each needs one CPU sampler device,
        float32; "auto" falls back to xla where the kernels are not allowed)."""
        return tuple(n for n in ("attention", "linear") if getattr(self, n) == "cpu_kernel")
