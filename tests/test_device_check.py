"""benchmarks/device_check.sh runs end to end on CPU in --smoke mode (tiny shapes, nothing downloaded), and
benchmarks/build_device_wheels.sh names exactly the packages the device check imports beyond the machine's."""

import json
import os
import re
import subprocess
import sys

from benchmarks.device_check_report import BARS, STAGES
from benchmarks.device_probe import PACKAGES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_device_check_smoke_runs_every_stage_and_writes_its_json(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # The script runs whatever Python it is given ($PYTHON), as the lent machine's own.
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHON=sys.executable)
    out = tmp_path / "dc"
    proc = subprocess.run(
        ["bash", "benchmarks/device_check.sh", "--smoke", "--out", str(out), "--wheels", str(tmp_path / "-")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=2400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "device_check.json").read_text())
    assert list(res["stages"]) == list(STAGES) and all(s["rc"] == 0 for s in res["stages"].values())
    for name in ("env", "decode", "attention", "train_memory"):  # the probe's own stages mark completion
        assert res[name]["done"], name
    assert res["env"]["missing"] == {}
    points = [(p["batch"], p["context"]) for p in res["decode"]["points"]]
    assert points == [(1, 16), (1, 32)] and res["decode"]["skipped"] == []  # in --points order
    assert all(p["tok_s"] > 0 and p["host_gap_s"] >= 0 for p in res["decode"]["points"])
    for layout in res["attention"]["layouts"].values():  # the run's attention vs blocked, same inputs
        assert layout["max_grad_diff"] < 1e-4 and abs(layout["loss"] - layout["loss_blocked"]) < 1e-3
    tm = res["train_memory"]
    # On CPU the plan check and this device compile the same programs: the figures agree exactly.
    assert tm["plan_check_peak_bytes"] == tm["compiled_here_peak_bytes"] > 0
    assert res["train_mfu"]["train_tokens_per_s"] > 0
    assert res["sync_1p5b"]["colocated"]["sync_GBps"] > 0 and res["sync_8b"]["colocated"]["sync_s"] > 0
    assert res["run"]["tags_missing"] == [] and res["run"]["last_step"] == 3
    assert set(res["bars"]) == set(BARS)
    # Correctness checks: attention (forward and backward, padding included) and the run's steps.
    assert res["checks"] == {
        "attention_one_segment_agrees": True, "attention_packed_agrees": True, "run_steps_finite": True
    }  # fmt: skip


def test_the_wheel_list_covers_the_imports_the_lent_machine_lacks():
    with open(os.path.join(REPO, "benchmarks", "build_device_wheels.sh")) as f:
        script = f.read()
    pins = re.finditer(r"^\s+([A-Za-z0-9_.-]+)==", script, re.M)
    wheels = {m.group(1).lower().replace("-", "_") for m in pins}
    # What the lent machine lacks (its package list) and the module each one provides.
    lacking = {
        "ml_collections": "ml_collections",
        "grain": "grain",
        "array_record": "array_record",
        "tensorboardx": "tensorboardX",
        "math_verify": "math_verify",
        "pyzmq": "zmq",
        "latex2sympy2_extended": "latex2sympy2_extended",
        "antlr4_python3_runtime": "antlr4",
    }
    assert set(lacking) <= wheels
    assert set(lacking.values()) <= set(PACKAGES)  # the env stage imports each of them


def _stand_in_cudnn(shift: int):
    """A CPU stand-in for cuDNN's packed-layout kernel, with `fa.dot_product_attention`'s arguments: exact
    attention within the segments its lengths and offsets describe, nothing written at padding (zeros, as
    `attention._cudnn_packed` selects). `shift` moves every segment's offset: the error a wrong packed
    layout makes."""
    import jax.numpy as jnp

    from jaxrl_async.model import attention

    def kernel(q, k, v, bias, mask, q_seqlen, kv_seqlen, q_offsets, kv_offsets, scale, mask_type):
        b, t = q.shape[:2]
        pos = jnp.arange(t)[None, None, :]
        start, length = q_offsets[:, :-1, None] + shift, q_seqlen[:, :, None]
        inside_BxMxT = (pos >= start) & (pos < start + length) & (length > 0)
        seg = jnp.where(inside_BxMxT.any(1), jnp.argmax(inside_BxMxT, axis=1) + 1, 0)
        allowed = attention.packed_causal_mask(seg, t, b) & (seg != 0)[:, :, None]
        out = attention.reference_attention(q, k, v, allowed)
        return jnp.where((seg != 0)[:, :, None, None], out, 0).astype(q.dtype)

    return kernel


def test_the_attention_stage_passes_a_right_kernel_and_fails_one_with_wrong_offsets(monkeypatch):
    """The stage's loss and comparison read real positions only: a right stand-in for cuDNN (exact on real
    tokens, zeros at padding) agrees with the blocked path, though the two differ at padding; the same
    stand-in with every segment offset by one position fails."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax._src.cudnn import fused_attention_stablehlo as fa

    from benchmarks.device_probe import attention_loss, compare_attention

    rng = np.random.default_rng(0)
    t, h, g, kd = 256, 4, 2, 32
    seg = np.zeros((1, t), np.int32)
    for sid, (a, b) in enumerate([(0, 40), (40, 110), (110, 140), (140, 200)], start=1):
        seg[0, a:b] = sid  # four sequences, then 56 positions of padding
    seg = jnp.asarray(seg)
    q = jnp.asarray(rng.standard_normal((1, t, h, kd)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((1, t, g, kd)), jnp.bfloat16) for _ in range(2))
    w = jnp.asarray(rng.standard_normal((1, t, h, kd)), jnp.bfloat16)
    blocked = attention_loss("blocked", seg, w)(q, k, v)
    results = {}
    for shift in (0, 1):
        monkeypatch.setattr(fa, "dot_product_attention", _stand_in_cudnn(shift))
        # "dot_product" built for a GPU: the packed cuDNN path, here through the stand-in
        packed = attention_loss("dot_product", seg, w, "gpu")(q, k, v)
        results[shift] = compare_attention(packed, blocked, seg)
    assert results[0]["agrees"] and results[0]["max_grad_rel_diff"] < 0.02, results[0]
    assert results[1]["finite"] and not results[1]["agrees"], results[1]
    # Padding differs between the two by design and is not compared: the blocked path's padding attends to
    # itself, the stand-in's is zero; with padding outputs out of the loss both gradients vanish there.
    dq = jax.tree.leaves(blocked[1])[0]
    assert not bool(jnp.any(dq[0, 200:] != 0))


def test_the_decode_stage_skips_a_point_the_plan_says_will_not_fit():
    """Qwen3-8B at batch 64 x 8k holds ~94 GB of weights and KV: not on an 80 GB H100 (0.92 of it usable
    under launch/gpu_node.sh), on a 141 GB H200 yes; batch 1 x 1k fits both. (The smoke run above shows
    the points run in `--points` order, each in a process of its own.)"""
    from benchmarks.device_probe import decode_fit
    from jaxrl_async.model import presets
    from jaxrl_async.perf.hardware import get_hardware

    model = presets.get("qwen3-8b", dtype="bfloat16", param_dtype="bfloat16")
    why = decode_fit(model, 64, 8192, 64, get_hardware("h100"))
    assert why is not None and "GiB usable on h100" in why
    assert decode_fit(model, 64, 8192, 64, get_hardware("h200")) is None
    assert decode_fit(model, 1, 1024, 64, get_hardware("h100")) is None
