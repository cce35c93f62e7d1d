"""Plan check: the train step compiles for a trainer mesh on abstract arrays and reports memory."""

import dataclasses
import glob
import os
import re
import shlex
import subprocess
import sys

import jax
import pytest

from jaxrl_async.model import param_specs, presets
from jaxrl_async.runtime.plan_check import (
    GPU_NODE_MEM_FRACTION,
    MIN_HEADROOM,
    decode_memory,
    fallback_line,
    headroom,
    kv_cache_bytes,
    mem_fraction,
    plan_check,
    sampler_weight_bytes,
    sharding_fallbacks,
    target_platform,
    train_memory,
    trainer_attention,
)
from jaxrl_async.sampler import SamplerConfig
from jaxrl_async.sharding import TRAINER_RULES, make_mesh
from jaxrl_async.trainer import TrainConfig

CFG = presets.tiny(vocab_size=256, n_layers=2)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The console script a user types, from this interpreter's environment (its module where none is installed).
_SCRIPT = os.path.join(os.path.dirname(sys.executable), "jaxrl-plan-check")
PLAN_CHECK = [_SCRIPT] if os.path.exists(_SCRIPT) else [sys.executable, "-m", "jaxrl_async.cli.plan_check"]


def test_the_dimensions_replicated_for_want_of_an_even_split_are_listed_as_spec_replicates_them():
    """2 KV heads on a tensor axis of 4: k, v and the KV cache's heads fall back in both roles and nothing
    else does; each listed dimension is one that `Rules.spec` leaves unsharded on a real mesh, and a tensor
    axis of 2 lists nothing."""
    sampler = SamplerConfig(num_slots=8, max_prompt_len=16, max_new_tokens=16)

    @dataclasses.dataclass
    class Mesh:
        sampler: tuple = (2, 4)
        trainer: tuple = (1, 4)

    assert CFG.n_kv_heads == 2 and CFG.n_heads % 4 == 0
    fb = sharding_fallbacks(CFG, sampler, Mesh())
    assert {f["leaf"] for f in fb["trainer"]} == {"layers/k", "layers/v"}
    assert {f["leaf"] for f in fb["sampler"]} == {"params/layers/k", "params/layers/v", "kv_cache"}
    for f in fb["trainer"] + fb["sampler"]:
        assert (f["logical"], f["dim"], f["mesh_axis"], f["axis_size"]) == ("kv_heads", 2, "tensor", 4)
    assert fallback_line("trainer", fb["trainer"]) == (
        "  trainer sharding, replicated where the rules shard (the axis does not divide): "
        "kv_heads (2) over tensor (4) in 2 leaves: layers/k, layers/v"
    )
    mesh = make_mesh((1, 4), ("fsdp", "tensor"), jax.devices()[:4])
    k = param_specs(CFG)["layers"]["k"]
    assert TRAINER_RULES.spec(k.logical_axes, k.shape, mesh)[k.logical_axes.index("kv_heads")] is None
    assert TRAINER_RULES.spec(k.logical_axes)[k.logical_axes.index("kv_heads")] == "tensor"
    even = sharding_fallbacks(CFG, sampler, Mesh(sampler=(4, 2), trainer=(2, 2)))
    assert even == {"trainer": [], "sampler": []}
    assert fallback_line("sampler", []).endswith("every dimension the rules shard divides its mesh axis")


def test_train_memory_grows_with_the_micro_batch_and_shrinks_with_sharding():
    small = train_memory(
        TrainConfig(token_budget=64, rows_per_micro=4, minibatches=1), CFG, (2, 1), jax.devices()[:2]
    )
    big = train_memory(
        TrainConfig(token_budget=256, rows_per_micro=4, minibatches=1), CFG, (2, 1), jax.devices()[:2]
    )
    assert small["argument_size"] > 0 and big["temp_size"] > small["temp_size"]
    four = train_memory(
        TrainConfig(token_budget=64, rows_per_micro=4, minibatches=1), CFG, (4, 1), jax.devices()[:4]
    )
    # fsdp shards params and optimizer state: 4 devices hold less each than `small`'s 2 (a third compile,
    # on 1 device, would show the same at its cost).
    assert four["argument_size"] < small["argument_size"]


def test_sampler_bytes_and_full_report():
    s = SamplerConfig(num_slots=8, max_prompt_len=16, max_new_tokens=16)
    per_slot = 2 * CFG.n_layers * CFG.n_kv_heads * CFG.head_dim * s.slot_len * 4
    assert kv_cache_bytes(CFG, 8, s.slot_len, (2, 1), 4) == 4 * per_slot
    assert kv_cache_bytes(CFG, 8, s.slot_len, (2, 2), 4) == 2 * per_slot  # 2 KV heads split over tensor=2
    assert sampler_weight_bytes(CFG, (1, 2), 4) < sampler_weight_bytes(CFG, (2, 1), 4)

    @dataclasses.dataclass
    class Mesh:
        sampler: tuple = (2, 1)
        trainer: tuple = (2, 1)

    mixed = CFG.replace(dtype="bfloat16", param_dtype="float32")
    report = plan_check(mixed, TrainConfig(token_budget=64, rows_per_micro=2), s, Mesh())
    assert report["trainer"]["peak_estimate"] > 0
    assert report["trainer"]["dtypes"] == {"params": ["float32"], "optimizer_state": ["float32"]}
    sampler = report["sampler"]
    assert sampler["dtypes"] == ["bfloat16"]
    # Every buffer a sampler device holds: the weights twice (the eval engine's own copy, the default
    # config.eval_weights="own"), the sampler's and the eval engine's KV caches (plus a few bytes of
    # per-slot scalars each), as counted analytically.
    an = sampler["analytic"]
    assert sampler["weights"] == an["weights"] and sampler["weight_copies"] == 2
    slots = s.num_slots + sampler["eval_slots"]
    assert an["total"] <= sampler["held"] <= an["total"] + slots * 64
    gen, ev = sampler["generate"], sampler["eval_generate"]
    assert sampler["held"] == gen["argument_size"] + ev["argument_size"]
    # What the executable store's key costs for the program: its StableHLO's bytes, and the seconds to
    # print and hash them.
    assert gen["stablehlo_bytes"] > 10_000 and 0 < gen["stablehlo_key_s"] < 60
    assert sampler["peak"] >= sampler["held"] + sampler["weights"]  # a weight update holds one more copy
    # Shared with the sampler's engine (config.eval_weights="shared"): one copy fewer.
    train = TrainConfig(token_budget=64, rows_per_micro=2)
    shared = plan_check(mixed, train, s, Mesh(), eval_weights="shared")
    assert shared["sampler"]["held"] == sampler["held"] - sampler["weights"]


def test_memory_efficient_attention_shows_in_the_compiled_train_step():
    long = TrainConfig(token_budget=1024, rows_per_micro=2, minibatches=1)
    ref = train_memory(long, CFG.replace(attention="reference"), (2, 1), jax.devices()[:2])
    splash = train_memory(long, CFG.replace(attention="splash"), (2, 1), jax.devices()[:2])
    # Reference: float32 scores [heads, T, T] per row (4 MiB a head here); splash keeps O(T) buffers.
    assert splash["temp_size"] < ref["temp_size"] - CFG.n_heads * 1024 * 1024 * 4
    assert (ref["attention"]["compiled_as"], splash["attention"]["compiled_as"]) == ("reference", "splash")


def test_the_target_platform_decides_the_attention_compiled():
    bf16 = TrainConfig(token_budget=4096, compute_dtype="bfloat16")
    gpu = trainer_attention(bf16, CFG, "gpu")
    # cuDNN's packed layout: segment lengths and offsets, no [T, T] mask, but a float32 backward workspace
    # per segment slot (2 x rows x heads x T x head_dim values), measured on an H200.
    ws = 2 * 1 * 8 * CFG.n_heads * 4096 * CFG.head_dim * 4
    assert gpu == {"target": "cudnn", "compiled_as": "splash", "max_segments": 8, "workspace_bytes": ws}
    # A (2, 2) mesh splits 4 rows over fsdp and the heads over tensor: the same bytes per device.
    split = trainer_attention(dataclasses.replace(bf16, rows_per_micro=4), CFG, "gpu", (2, 2))
    assert split["workspace_bytes"] == ws * 2 // 2
    long = trainer_attention(dataclasses.replace(bf16, token_budget=65536), CFG, "gpu")
    assert (long["max_segments"], long["workspace_bytes"]) == (16, ws * 16 * 16 // 8)
    assert trainer_attention(bf16, CFG, "tpu")["workspace_bytes"] == 0
    assert trainer_attention(bf16, CFG.replace(attention="blocked"), "gpu")["compiled_as"] == "blocked"
    with pytest.raises(ValueError, match="config.model.attention"):
        trainer_attention(bf16, CFG.replace(attention="splash"), "gpu")
    assert trainer_attention(bf16, CFG, "tpu")["target"] == "splash"
    assert trainer_attention(bf16, CFG, "cpu")["compiled_as"] == "reference"
    assert trainer_attention(TrainConfig(token_budget=64), CFG, "gpu")["compiled_as"] == "dot_product"
    assert trainer_attention(bf16, CFG.replace(attention="reference"), "gpu")["compiled_as"] == "reference"
    assert [target_platform(n) for n in ("h100", "tpu-v5p", "cpu")] == ["gpu", "tpu", "cpu"]


def test_decode_memory_is_compiled_and_tracks_the_kv_cache():
    small = decode_memory(
        CFG, SamplerConfig(num_slots=4, max_prompt_len=16, max_new_tokens=16), (1, 1), jax.devices()[:1]
    )
    big = decode_memory(
        CFG, SamplerConfig(num_slots=16, max_prompt_len=16, max_new_tokens=16), (1, 1), jax.devices()[:1]
    )
    per_slot = 2 * CFG.n_layers * CFG.n_kv_heads * CFG.head_dim * 32 * 4
    # 12 more slots: the argument bytes grow by exactly their KV cache (plus a few per-slot scalars).
    assert 12 * per_slot <= big["argument_size"] - small["argument_size"] <= 12 * per_slot + 12 * 64
    split = decode_memory(
        CFG, SamplerConfig(num_slots=16, max_prompt_len=16, max_new_tokens=16), (2, 1), jax.devices()[:2]
    )
    assert split["argument_size"] < big["argument_size"]  # slots split over the data axis


def test_decode_memory_of_a_bf16_model_drops_the_cpu_upcast_copies():
    bf16 = dataclasses.replace(CFG, dtype="bfloat16", param_dtype="bfloat16")
    s = SamplerConfig(num_slots=8, max_prompt_len=16, max_new_tokens=16)
    m = decode_memory(bf16, s, (1, 1), jax.devices()[:1])
    f32 = decode_memory(CFG, s, (1, 1), jax.devices()[:1])
    assert m["argument_size"] < f32["argument_size"]  # bf16 weights and KV cache
    assert m["temp_size_accelerator"] == f32["temp_size"]  # temporaries taken from the f32 twin
    assert f32["temp_size_accelerator"] == f32["temp_size"]
    assert m["peak_accelerator"] >= m["argument_size"]


def test_the_memory_fraction_is_the_launchers_and_a_short_margin_is_refused_by_name():
    with open(os.path.join(REPO, "launch", "gpu_node.sh")) as f:
        launcher = f.read()
    assert f"XLA_PYTHON_CLIENT_MEM_FRACTION:-{GPU_NODE_MEM_FRACTION}" in launcher
    assert mem_fraction("gpu", {}) == (GPU_NODE_MEM_FRACTION, "launch/gpu_node.sh")
    env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.8"}
    assert mem_fraction("gpu", env) == (0.8, "XLA_PYTHON_CLIENT_MEM_FRACTION")
    assert mem_fraction("tpu", env)[0] == 1.0
    with pytest.raises(ValueError, match="XLA_PYTHON_CLIENT_MEM_FRACTION"):
        mem_fraction("gpu", {"XLA_PYTHON_CLIENT_MEM_FRACTION": "1.5"})
    gib = 2**30
    usable = 100 * gib * 0.9
    peaks = {"trainer": usable - 10 * gib, "sampler": usable - 5 * gib}
    room, refusals = headroom(peaks, 100 * gib, 0.9, 0.08)
    assert room["trainer"]["ok"] and not room["sampler"]["ok"]
    assert room["sampler"]["headroom_bytes"] == 5 * gib
    (msg,) = refusals
    assert msg.startswith("sampler: peak 85.00 GiB of 90.00 GiB usable (100.0 GiB x memory fraction 0.90)")
    assert "under the 8% margin (7.20 GiB)" in msg and "config.sampler.num_slots" in msg
    assert 0 < MIN_HEADROOM < 0.5


def _documented_plan_checks() -> list[str]:
    """Every plan-check command line in README.md and docs/*.md, as written there."""
    commands = []
    for path in [os.path.join(REPO, "README.md"), *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]:
        with open(path) as f:
            for line in f:
                m = re.match(r"\s*(jaxrl-plan-check [^#`]*)", line)
                if m and m.group(1).strip() not in commands:
                    commands.append(m.group(1).strip())
    return commands


def test_the_documented_plan_check_commands_succeed_verbatim():
    """README's "will it fit?" lines and the performance-model doc's, run as written (a fresh shell: no
    XLA flags, no memory fraction set, no data file): each exits 0 with both roles inside the margin."""
    commands = _documented_plan_checks()
    readme = "jaxrl-plan-check --config configs/math_8b.py:h100 --preset qwen3-8b --hardware h100"
    assert readme in commands
    assert len(commands) >= 3
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION")}
    env["PYTHONPATH"] = REPO
    procs = []
    for cmd in commands:  # all at once: each is mostly one compile thread
        argv = shlex.split(cmd)
        assert argv[0] == "jaxrl-plan-check"
        procs.append(subprocess.Popen([*PLAN_CHECK, *argv[1:]], cwd=REPO, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))  # fmt: skip
    for cmd, proc in zip(commands, procs, strict=True):
        out, _ = proc.communicate(timeout=1800)
        assert proc.returncode == 0, (cmd, out[-3000:])
        for role in ("trainer", "sampler"):
            assert re.search(rf"{role} headroom: .* -> ok", out), (cmd, out[-2000:])
            assert re.search(rf"\n  {role} sharding[:,] ", out), (cmd, out[-2000:])
        assert re.search(r"executable store key .*: generate's is \d+\.\d\d MiB, printed and hashed in "
                         r"\d+\.\d{3} s", out), (cmd, out[-2000:])  # fmt: skip


def test_a_layout_under_the_margin_is_refused_with_the_numbers_and_fields():
    """The command exits 1 and names the role, the figures and the fields (tiny config, a memory fraction
    so small that nothing fits). With --lora-rank the same compile also shows the LoRA override taken: the
    sync moves the adapters, the trainer holds a frozen base and the sampler keeps the base it received."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = REPO
    cmd = [
        *PLAN_CHECK,
        "--config",
        "configs/tiny_arith.py",
        "--hardware",
        "h100",
        "--mem-fraction",
        "1e-6",
        "--lora-rank",
        "4",
    ]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    assert "plan check refuses this layout" in res.stdout
    assert re.search(
        r"trainer: peak .* GiB usable \(74\.5 GiB x memory fraction 0\.00\) .* under the 8% margin",
        res.stdout,
    )
    assert "config.mesh.trainer" in res.stdout and "config.sampler.num_slots" in res.stdout
    assert "weight sync: the LoRA adapters" in res.stdout
    assert re.search(r"declared: LoRA rank 4 adapters \(float32\) .* \+ frozen base", res.stdout)
    assert re.search(r"LoRA \(config.sampler.lora_apply='unmerged'\): the base received .* kept", res.stdout)


def test_the_balance_and_the_evaluation_cost_come_from_the_measured_points_and_warn_past_the_limit():
    """perf.balance: the measured H200 fractions of the roofline at their own points; a layout decoding 7
    sequences per H100 is sampler-bound; the first evaluation's cost in train steps, and the warning when
    it passes --max-eval-steps (and not below it)."""
    from configs import math_8b
    from jaxrl_async.perf import balance
    from jaxrl_async.perf.hardware import get_hardware
    from jaxrl_async.run_config import memory_sections

    for (b, ctx), frac in balance.MEASURED_DECODE_FRACTION.items():
        assert balance.decode_fraction(b, ctx) == pytest.approx(frac)
    assert balance.decode_fraction(8, 4096) < balance.decode_fraction(1, 1024)
    c = math_8b.get_config("h100")
    model = presets.get("qwen3-8b", dtype="bfloat16", param_dtype="float32")
    sec = memory_sections(c.to_dict())
    h100, h200 = get_hardware("h100"), get_hardware("h200")
    assert balance.decode_step_s(model, h100, 1, 1024) == pytest.approx(
        balance.decode_step_s(model, h200, 1, 1024) * h200.mem_bw / h100.mem_bw
    )
    slow = balance.predict(c, model, h100, sec["sampler"], sec["trainer"], 512, 4096, 256, 4, decode_batch=7)
    fast = balance.predict(c, model, h100, sec["sampler"], sec["trainer"], 512, 4096, 256, 4, decode_batch=64)
    assert slow.bound == "sampler" and slow.sampler_s > fast.sampler_s > 0
    assert slow.trainer_s == fast.trainer_s
    assert slow.eval_worst_s > slow.eval_s > 0 and 0 < slow.eval_sampling_loss < 1
    assert slow.eval_train_steps == pytest.approx(slow.eval_s / slow.step_s)
    warn = balance.report_lines(slow, max_eval_steps=slow.eval_train_steps * 0.9)
    assert "warning: one evaluation may cost" in warn and "config.eval_prompts" in warn
    assert "warning" not in balance.report_lines(slow, max_eval_steps=slow.eval_train_steps * 1.1)
    assert "sampler-bound by" in warn and "first evaluation:" in warn


def test_lora_moves_adapter_bytes_and_holds_a_frozen_base_with_float32_adapter_state():
    """config.trainer.lora in the plan check and the perf model: the sync term moves the adapters' bytes
    instead of the model's, and the trainer holds the base in the compute dtype beside float32 adapters
    with AdamW's two moments, instead of float32 masters and moments of the whole model. The adapter sizes
    are counted here from the projections' shapes; the declared state agrees with the traced train step."""
    import math

    from jaxrl_async.model.lora import LoraConfig
    from jaxrl_async.perf.shapes import shape_from_model_config
    from jaxrl_async.perf.weight_sync import link_for
    from jaxrl_async.run_config import MeshConfig
    from jaxrl_async.runtime.plan_check import trainer_state_bytes, weight_sync_plan
    from jaxrl_async.trainer.train_step import trace_abstract

    model = CFG.replace(dtype="bfloat16", param_dtype="float32")
    lora = LoraConfig(enabled=True, rank=4)
    layer = param_specs(model)["layers"]
    adapter_numbers = 0
    for t in lora.targets:  # A: [L, *in, r], B: [L, r, *out]; o's input is its two leading dims (heads, dim)
        shape = layer[t].shape
        c = 2 if t == "o" else 1
        adapter_numbers += shape[0] * lora.rank * (math.prod(shape[1 : 1 + c]) + math.prod(shape[1 + c :]))
    model_numbers = sum(math.prod(s.shape) for s in jax.tree.leaves(param_specs(model), is_leaf=_is_spec))

    full_cfg = TrainConfig(token_budget=64, rows_per_micro=2, minibatches=1)
    lora_cfg = dataclasses.replace(full_cfg, lora=lora)
    full, low = (trainer_state_bytes(c, model, (1, 1)) for c in (full_cfg, lora_cfg))
    assert (full["params"], full["optimizer_state"]) == (4 * model_numbers, 8 * model_numbers)
    assert full["frozen"] == 0
    assert (low["params"], low["optimizer_state"]) == (4 * adapter_numbers, 8 * adapter_numbers)
    assert low["frozen"] == 2 * model_numbers  # bf16
    assert full["gradients"] == full["params"] and low["gradients"] == low["params"]
    assert full["total"] == 16 * model_numbers and low["total"] == 2 * model_numbers + 16 * adapter_numbers

    mesh = MeshConfig(sampler=(1, 1), trainer=(2, 1))
    ws_full, ws_lora = (weight_sync_plan(model, x, mesh, "h100") for x in (None, lora))
    assert (ws_full["bytes"], ws_lora["bytes"]) == (2 * model_numbers, 2 * adapter_numbers)
    latency = link_for("h100").latency_s  # the rest of a version's seconds scale with its bytes
    ratio = (ws_full["seconds"] - latency) / (ws_lora["seconds"] - latency)
    assert ratio == pytest.approx(model_numbers / adapter_numbers, rel=1e-9) and ratio > 10

    shape = shape_from_model_config(model, lora=lora)  # the perf model's System takes sync_bytes
    assert shape.sync_bytes == 2 * adapter_numbers
    assert shape.train_state_bytes(16) == 2 * shape.params + 16 * adapter_numbers

    # Sharded (fsdp 2), against what the train step is traced with.
    traced = trace_abstract(lora_cfg, model, make_mesh((2, 1), ("fsdp", "tensor"), jax.devices()[:2]))
    state = traced["state"]
    per_device = lambda tree: sum(  # noqa: E731
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)
    )
    declared = trainer_state_bytes(lora_cfg, model, (2, 1))
    assert declared["params"] == per_device(state.params) and declared["frozen"] == per_device(state.frozen)
    assert 0 <= traced["optimizer_state_bytes"] - declared["optimizer_state"] <= 64  # + AdamW's step counters
    assert declared["frozen"] < low["frozen"]  # the base is sharded too


def _is_spec(x) -> bool:
    return hasattr(x, "logical_axes")


def test_a_lora_samplers_memory_and_update_follow_what_it_holds_and_receives_in_each_apply_mode():
    """The sampler side of a LoRA run (one device, float32, so every figure is 4 bytes a number counted
    from the shapes): it keeps the base it received at start beside its decode layout and receives only
    the adapters per version; "unmerged" carries them in each engine's decode layout and an update lays
    out only them, "merge" decodes a plain layout but writes a whole merged copy per version."""
    import math

    from jaxrl_async.model.lora import LoraConfig
    from jaxrl_async.runtime.plan_check import sampler_memory

    lora = LoraConfig(enabled=True, rank=4)
    layer = param_specs(CFG)["layers"]
    adapters = 0
    for t in lora.targets:  # A: [L, *in, r], B: [L, r, *out]; o's input is its two leading dims (heads, dim)
        shape, c = layer[t].shape, 3 if t == "o" else 2
        adapters += 4 * shape[0] * lora.rank * (math.prod(shape[1:c]) + math.prod(shape[c:]))
    base = 4 * sum(math.prod(s.shape) for s in jax.tree.leaves(param_specs(CFG), is_leaf=_is_spec))
    s = SamplerConfig(num_slots=4, max_prompt_len=8, max_new_tokens=8)
    devices = jax.devices()[:1]
    full = sampler_memory(CFG, s, (1, 1), devices, eval_slots=4)
    unmerged = sampler_memory(CFG, s, (1, 1), devices, eval_slots=4, lora=lora)
    merge = sampler_memory(CFG, dataclasses.replace(s, lora_apply="merge"), (1, 1), devices, 4, lora=lora)
    assert full["weight_copies"] == 2  # config.eval_weights="own": the eval engine's layout too

    assert (full["received_per_version"], full["received_base"]) == (base, 0)
    assert full["update_transient"] == full["weights"]
    for lo in (unmerged, merge):
        assert (lo["received_per_version"], lo["received_base"]) == (adapters, base)
    assert unmerged["weights"] - full["weights"] == adapters  # each layout carries the adapters
    assert unmerged["held"] - full["held"] == 2 * adapters + base
    assert unmerged["update_transient"] == 2 * adapters  # incoming + their new layout
    assert merge["weights"] == full["weights"] and merge["held"] - full["held"] == base
    assert merge["update_transient"] == base + adapters  # the merged copy beside the incoming adapters
    for lo in (full, unmerged, merge):  # the analytic count agrees with the compiled one
        an = lo["analytic"]
        slots = s.num_slots + lo["eval_slots"]
        assert an["total"] <= lo["held"] <= an["total"] + slots * 64
