"""The system both the analytic model and the simulator evaluate: sampler, trainer, workload, η.

`build_system` turns physical inputs (hardware, model shape, optional benchmark files) into it.

Train-bench JSON (written by benchmarks/bench_train.py, read by `load_train_bench`)::

    {"devices": 8, "train_tokens_per_s": 12345.0}   # tokens (prompt + response) per second, all devices
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np

from jaxrl_async.paging import mean_resident_tokens
from jaxrl_async.perf.hardware import Hardware
from jaxrl_async.perf.latency import DecodeBench, DecodeLatency, latency_from_hardware
from jaxrl_async.perf.shapes import ModelShape
from jaxrl_async.perf.weight_sync import Link, get_link, link_for, sync_seconds
from jaxrl_async.perf.workload import Workload


@dataclasses.dataclass(frozen=True)
class Sampler:
    """Sampler replicas with continuous batching.

    Attributes:
      latency: decode step time t(b) of one replica.
      devices_per_replica: devices one replica spans (tensor parallel degree).
      max_batch: decode slots per replica (KV-cache memory cap).
      prefill_s: replica stall per admitted sample (its share of the prompt prefill).
      update_s: replica stall to load a new policy version.
      static_batch: every decode step costs t(max_batch), however few slots are busy (a static-shape
        engine, such as this project's slotted XLA decode); False: t(busy slots) (paged / ragged engines).
        It matters when few slots are busy: in the window-bound regime and in a sync batch's tail.
      admit_lag_s: seconds from a group's last token until the trainer can take it (an engine notices
        finished sequences between decode calls, one call late when it overlaps the host with the
        device) plus from a new version until its cohort decodes (the next call boundary); it lies on the
        staleness window's critical path, nowhere else.
    """

    latency: DecodeLatency
    devices_per_replica: int
    max_batch: int
    prefill_s: float = 0.0
    update_s: float = 0.0
    static_batch: bool = False
    admit_lag_s: float = 0.0

    def step_s(self, busy):
        """Seconds per decode step with `busy` sequences in the replica (scalar or array)."""
        if self.static_batch:
            busy = np.full_like(np.asarray(busy, dtype=float), self.max_batch)
        return self.latency.step_s(busy)

    def __post_init__(self):
        if self.devices_per_replica <= 0 or self.max_batch <= 0:
            raise ValueError("Sampler needs devices_per_replica > 0 and max_batch > 0")
        if self.prefill_s < 0 or self.update_s < 0 or self.admit_lag_s < 0:
            raise ValueError("Sampler prefill_s, update_s and admit_lag_s must be >= 0")


@dataclasses.dataclass(frozen=True)
class Trainer:
    """Data-parallel trainer: step time = tokens / (tokens_per_s_per_device * devices) + step_overhead_s."""

    tokens_per_s_per_device: float
    min_devices: int = 1
    step_overhead_s: float = 0.0

    def __post_init__(self):
        if self.tokens_per_s_per_device <= 0 or self.min_devices <= 0 or self.step_overhead_s < 0:
            raise ValueError(
                "Trainer needs tokens_per_s_per_device > 0, min_devices > 0, step_overhead_s >= 0"
            )

    def step_s(self, tokens: float, devices: int) -> float:
        return tokens / (self.tokens_per_s_per_device * devices) + self.step_overhead_s


@dataclasses.dataclass(frozen=True)
class System:
    """Everything the split sweep needs; `max_staleness` is η of the admission rule."""

    total_devices: int
    sampler: Sampler
    trainer: Trainer
    workload: Workload
    max_staleness: int
    sync_link: Link | None = None  # the weight sync's link (None: not charged)
    sync_weight_bytes: float = 0.0  # bytes of one version in the sampler's dtype

    def __post_init__(self):
        if self.total_devices <= 0 or self.max_staleness < 0:
            raise ValueError("System needs total_devices > 0 and max_staleness >= 0")

    def sync_s(self, trainer_devices: int, sampler_devices: int) -> float:
        """Seconds per version to move the weights to every replica (charged to the trainer's step)."""
        if self.sync_link is None:
            return 0.0
        reps = max(self.replicas(sampler_devices), 1)
        return sync_seconds(self.sync_weight_bytes * reps, self.sync_link, trainer_devices, sampler_devices)

    def replicas(self, sampler_devices: int) -> int:
        return sampler_devices // self.sampler.devices_per_replica

    def train_tokens(self, mean_len: float) -> float:
        """Tokens (prompt + response) in one train batch with mean response length `mean_len`."""
        return self.workload.samples_per_batch * (self.workload.prompt_len + mean_len)


def load_train_bench(path: str) -> tuple[float, int]:
    """Read a train benchmark JSON file; returns (train_tokens_per_s over all devices, devices)."""
    with open(path) as f:
        d = json.load(f)
    return float(d["train_tokens_per_s"]), int(d.get("devices", 1))


def mean_decode_context(workload: Workload) -> float:
    """Token-weighted mean context while decoding: P + E[L^2] / (2 E[L])."""
    lens = workload.lengths.representative(4000).astype(float)
    return workload.prompt_len + float(np.mean(lens**2) / (2 * np.mean(lens)))


def kv_tokens_per_sequence(
    workload: Workload,
    kv_reserve: str,
    page_size: int = 16,
    steps_per_call: int = 8,
    share_prefix: bool = True,
) -> float:
    """KV tokens one decode slot costs under a reservation rule.

    "max": a slotted cache (every slot reserves prompt + the longest length). "mean": prompt + mean length
    (an idealised paged cache). "paged": the sampler's paged cache and admission rule
    (`jaxrl_async.paging.mean_resident_tokens`): running sequences hold prompt + E[L^2] / (2 E[L])
    positions on average, rounded to pages, one call of growth ahead, full prompt pages shared by a group.
    """
    if kv_reserve == "max":
        return workload.max_context
    if kv_reserve == "mean":
        return workload.prompt_len + workload.lengths.mean()
    if kv_reserve == "paged":
        lens = workload.lengths.representative(4000).astype(float)
        group = workload.samples_per_prompt if share_prefix else 1
        mean, mean_sq = float(np.mean(lens)), float(np.mean(lens**2))
        return mean_resident_tokens(workload.prompt_len, mean, mean_sq, page_size, group, steps_per_call)
    raise ValueError(f"kv_reserve must be 'max', 'mean' or 'paged', got {kv_reserve!r}")


def _default_tp(shape: ModelShape, hw: Hardware, max_weight_frac: float = 0.5) -> int:
    """Smallest power-of-two replica whose weights take at most `max_weight_frac` of its memory."""
    tp = 1
    while shape.weight_bytes > max_weight_frac * tp * hw.mem_bytes:
        tp *= 2
    return tp


def build_system(
    hw: Hardware,
    shape: ModelShape,
    workload: Workload,
    total_devices: int,
    max_staleness: int,
    *,
    decode_bench: DecodeBench | None = None,
    train_bench: tuple[float, int] | None = None,
    devices_per_replica: int | None = None,
    max_decode_batch: int | None = None,
    kv_reserve: str = "max",
    page_size: int = 16,
    steps_per_call: int = 8,
    mem_reserve_frac: float = 0.1,
    decode_mem_efficiency: float = 0.7,
    decode_compute_efficiency: float = 0.5,
    decode_overhead_s: float = 0.0,
    prefill_efficiency: float = 0.5,
    share_prefix: bool = True,
    train_mfu: float = 0.4,
    train_extra_forwards: int = 0,
    train_bytes_per_param: float = 16.0,
    train_overhead_s: float = 0.0,
    update_s: float = 0.0,
    static_batch: bool = False,
    sync_link: str = "auto",
) -> System:
    """Derive a System from hardware and model shape; benchmark files override the roofline guesses.

    Args:
      hw: one device.
      shape: the policy model.
      workload: batch and response-length distribution.
      total_devices: devices to split between sampler and trainer.
      max_staleness: η.
      decode_bench: measured t(b) points; their replica size becomes the sampler replica size.
      train_bench: (train_tokens_per_s, devices) measured; scaled linearly per device.
      devices_per_replica: sampler tensor-parallel degree (default: smallest power of two fitting 2x weights).
      max_decode_batch: optional cap on decode slots per replica (engine limit).
      kv_reserve: "max" (each slot reserves prompt + max length: a slotted cache), "mean" (prompt + mean
        length) or "paged" (the sampler's paged cache: see `kv_tokens_per_sequence`).
      page_size, steps_per_call: the sampler's, for kv_reserve="paged".
      mem_reserve_frac: fraction of replica memory kept for activations and fragmentation.
      decode_mem_efficiency, decode_compute_efficiency: achieved fractions of bandwidth / peak in decode.
      decode_overhead_s: fixed seconds per decode step.
      prefill_efficiency: achieved fraction of peak FLOP/s in prefill.
      share_prefix: the G samples of a prompt share one prefill (prefix cache / cloned pages).
      train_mfu: model FLOPs utilisation of the trainer when there is no train bench.
      train_extra_forwards: extra forward passes per trained token (e.g. recomputed proximal log-probs).
      train_bytes_per_param: trainer memory per trained parameter (weights, grads, Adam moments, master
        copy); a LoRA shape (`ModelShape.trainable_params`) adds its frozen base at param_bytes.
      train_overhead_s: fixed seconds per train step (optimizer, weight publish).
      update_s: sampler stall per weight update.
      static_batch: decode steps cost t(max batch) whatever the busy slots (see `Sampler`).
      sync_link: the weight sync's link (`perf.weight_sync.LINKS`; "auto": the hardware's one-node link;
        "none": not charged); its seconds per version are added to every train step.

    Returns:
      The System.
    """
    context = mean_decode_context(workload)
    if decode_bench is not None:
        tp = decode_bench.devices
        latency = decode_bench.fit()
        if decode_bench.context_len:
            # KV streaming grows with context: rescale the memory slope to this workload's context.
            scale = context / float(decode_bench.context_len)
            latency = dataclasses.replace(latency, kv_s_per_seq=latency.kv_s_per_seq * scale)
    else:
        tp = devices_per_replica or _default_tp(shape, hw)
        latency = latency_from_hardware(
            hw, shape, context, tp, decode_mem_efficiency, decode_compute_efficiency, decode_overhead_s
        )
    if devices_per_replica is not None and devices_per_replica != tp:
        raise ValueError(
            f"devices_per_replica={devices_per_replica} but the decode bench ran on {tp} devices"
        )
    per_seq_tokens = kv_tokens_per_sequence(workload, kv_reserve, page_size, steps_per_call, share_prefix)
    free = tp * hw.mem_bytes * (1 - mem_reserve_frac) - shape.weight_bytes
    slots = int(free // (shape.kv_bytes_per_token * per_seq_tokens))
    if max_decode_batch is not None:
        slots = min(slots, max_decode_batch)
    if slots < 1:
        raise ValueError(f"no KV-cache room: {free / 1e9:.1f} GB free per replica of {tp} device(s)")
    prompt_flops = workload.prompt_len * shape.decode_flops_per_token(workload.prompt_len / 2)
    prefill_s = prompt_flops / (hw.peak_flops * tp * prefill_efficiency)
    if share_prefix:
        prefill_s /= workload.samples_per_prompt
    sampler = Sampler(latency, tp, slots, prefill_s, update_s, static_batch)
    if train_bench is not None:
        tps = train_bench[0] / train_bench[1]
    else:
        flops = shape.train_flops_per_token(
            workload.prompt_len + workload.lengths.mean(), train_extra_forwards
        )
        tps = train_mfu * hw.peak_flops / flops
    min_dev = max(
        1, math.ceil(shape.train_state_bytes(train_bytes_per_param) / (hw.mem_bytes * (1 - mem_reserve_frac)))
    )
    trainer = Trainer(tps, min_dev, train_overhead_s)
    link = None if sync_link == "none" else link_for(hw.name) if sync_link == "auto" else get_link(sync_link)
    return System(total_devices, sampler, trainer, workload, max_staleness, link, shape.sync_bytes)
