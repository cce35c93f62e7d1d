"""The performance model's weight-sync term: seconds per version per link, charged by the split model."""

import pytest

from jaxrl_async.perf import model as perf_model
from jaxrl_async.perf.hardware import PRESETS
from jaxrl_async.perf.shapes import ModelShape
from jaxrl_async.perf.system import build_system
from jaxrl_async.perf.weight_sync import LINKS, link_for, sync_report, sync_seconds
from jaxrl_async.perf.workload import Workload, length_dist_from_dict

SHAPE = ModelShape(
    params=8e9, n_layers=36, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128, vocab_size=151936
)


def test_sync_seconds_scale_with_bytes_and_lanes():
    nv = LINKS["nvlink"]
    one = sync_seconds(16e9, nv, 1, 1)
    assert one == pytest.approx(16e9 / nv.bytes_per_s + nv.latency_s)
    assert sync_seconds(16e9, nv, 4, 4) == pytest.approx(16e9 / (4 * nv.bytes_per_s) + nv.latency_s)
    assert sync_seconds(16e9, LINKS["dcn"], 4, 4) == sync_seconds(16e9, LINKS["dcn"], 1, 1)  # one NIC
    by_link = sync_report(16e9, 4, 4)
    assert by_link["loopback"] > by_link["dcn"] > by_link["pcie"] > by_link["nvlink"]
    assert link_for("h100").name == "nvlink" and link_for("tpu-v5p").name == "ici"
    with pytest.raises(ValueError, match="sync_link"):
        link_for("my-gpu")


def test_the_split_model_charges_the_sync_to_the_train_step():
    wl = Workload(64, 8, 512, length_dist_from_dict({"kind": "uniform", "low": 100, "high": 2000}))
    kw = dict(devices_per_replica=1)
    none = build_system(PRESETS["h100"], SHAPE, wl, 8, 2, sync_link="none", **kw)
    slow = build_system(PRESETS["h100"], SHAPE, wl, 8, 2, sync_link="loopback", **kw)
    a, b = perf_model.analyze_split(none, 4, 4), perf_model.analyze_split(slow, 4, 4)
    assert a.sync_s == 0.0 and b.sync_s == pytest.approx(slow.sync_s(4, 4)) and b.sync_s > 1.0
    assert b.train_step_s == pytest.approx(a.train_step_s + b.sync_s)
    assert b.tokens_per_s <= a.tokens_per_s
    with pytest.raises(ValueError, match="unknown weight-sync link"):
        build_system(PRESETS["h100"], SHAPE, wl, 8, 2, sync_link="carrier-pigeon", **kw)
