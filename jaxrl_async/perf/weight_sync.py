"""The cost of one weight sync (trainer layout -> every sampler replica) per link kind.

`sync_seconds` is bytes / (per-lane bandwidth x lanes) + a fixed latency per version. A lane is one
trainer device sending its share to one sampler device over its own link (NVLink, ICI, PCIe); DCN and
loopback are one lane per host pair. The bandwidths are per direction. Where they come from
(docs/performance-model.md, "Weight sync"):

  loopback  measured on this project's 2-core CPU host: `benchmarks/bench_transport.py`, cross-process
            transfer-server pull (the figure in docs/history/benchmarks.md, weight sync); what processes
            on different hosts, or with config.mesh.weight_transport="transfer", pay
  shm       measured the same way: the shared-memory slots that processes of one CPU host use (one
            copy per version into a reused slot; the receiver maps it in place)
  pcie      PCIe 5.0 x16: 32 GT/s x 16 lanes, 128b/130b = 63 GB/s per direction (PCI-SIG spec);
            ~80% achieved by large DMA copies
  nvlink    H100/H200 SXM NVLink 4: 900 GB/s bidirectional per GPU = 450 GB/s per direction (NVIDIA
            H100 datasheet); ~80% achieved by large copies
  nvlink-h800  H800 SXM: NVLink cut to 400 GB/s bidirectional = 200 GB/s per direction (NVIDIA H800
            product brief)
  ici       TPU v5p: 4,800 Gbps ICI per chip (Google Cloud TPU v5p documentation) = 600 GB/s; v5e:
            1,600 Gbps = 200 GB/s; one link's share is taken (a sync uses one direction of one path)
  dcn       one 400 Gb/s NIC per host (ConnectX-7 class, 50 GB/s), ~80% achieved
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Link:
    """One kind of link between a trainer device and a sampler device.

    Attributes:
      name: the kind (a key of LINKS).
      bytes_per_s: achieved per-direction bandwidth of one lane.
      latency_s: fixed cost per version (setup, the last bucket's round trip).
      per_device: lanes scale with the devices on both sides (False: one lane per host pair).
      source: where the figure comes from.
    """

    name: str
    bytes_per_s: float
    latency_s: float
    per_device: bool
    source: str

    def __post_init__(self):
        if self.bytes_per_s <= 0 or self.latency_s < 0:
            raise ValueError(f"Link {self.name}: bytes_per_s must be > 0 and latency_s >= 0")


LINKS: dict[str, Link] = {
    "loopback": Link("loopback", 0.61e9, 0.02, False, "measured: benchmarks.bench_transport, 2-core"),
    "shm": Link("shm", 6.1e9, 2e-3, False, "measured: benchmarks.bench_transport, shm slots, 2-core"),
    "pcie": Link("pcie", 0.8 * 63e9, 1e-3, True, "PCIe 5.0 x16 spec, 80% achieved"),
    "nvlink": Link("nvlink", 0.8 * 450e9, 1e-3, True, "NVIDIA H100 SXM datasheet, 80% achieved"),
    "nvlink-h800": Link("nvlink-h800", 0.8 * 200e9, 1e-3, True, "H800: NVLink cut to 400 GB/s bidirectional"),
    "ici": Link("ici", 0.8 * 600e9 / 4, 1e-3, True, "Cloud TPU v5p docs (4,800 Gbps/chip, one of 4 links)"),
    "dcn": Link("dcn", 0.8 * 50e9, 5e-3, False, "one 400 Gb/s NIC per host, 80% achieved"),
}

# The link a one-node layout of each hardware preset syncs over (trainer and sampler on one node / slice).
DEFAULT_LINK = {"h100": "nvlink", "h200": "nvlink", "h800": "nvlink-h800", "tpu-v5e": "ici", "tpu-v5p": "ici",
                "tpu-v6e": "ici", "this-cpu": "shm"}  # fmt: skip


def get_link(name: str) -> Link:
    if name not in LINKS:
        raise ValueError(f"unknown weight-sync link {name!r}; known: {sorted(LINKS)}")
    return LINKS[name]


def link_for(hardware_name: str) -> Link:
    """The default link of a hardware preset (the one-node layout)."""
    if hardware_name not in DEFAULT_LINK:
        raise ValueError(
            f"no default weight-sync link for hardware {hardware_name!r}: set options.sync_link to one of "
            f"{sorted(LINKS)}"
        )
    return LINKS[DEFAULT_LINK[hardware_name]]


def sync_seconds(weight_bytes: float, link: Link, trainer_devices: int = 1, sampler_devices: int = 1
                 ) -> float:  # fmt: skip
    """Seconds to move one version (`weight_bytes` in the sampler's dtype) to every sampler device.

    The trainer devices send in parallel: lanes = min(trainer devices, sampler devices) for per-device
    links, else 1. With several replicas pass their total bytes (each replica gets its own copy).
    """
    if trainer_devices < 1 or sampler_devices < 1:
        raise ValueError("sync_seconds: trainer_devices and sampler_devices must be >= 1")
    lanes = min(trainer_devices, sampler_devices) if link.per_device else 1
    return weight_bytes / (link.bytes_per_s * lanes) + link.latency_s


def sync_report(weight_bytes: float, trainer_devices: int, sampler_devices: int, replicas: int = 1) -> dict:
    """Predicted seconds per version over every link kind (what jaxrl-perf prints): `replicas`
    sampler replicas over `sampler_devices` devices each receive `weight_bytes`."""
    return {
        name: sync_seconds(weight_bytes * replicas, link, trainer_devices, sampler_devices)
        for name, link in LINKS.items()
    }
