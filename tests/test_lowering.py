"""The flagship configs' programs lowered for their accelerators on this CPU (`runtime.lowering`).

For math_8b (v5p and :h100 layouts) and qwen_1p5b_math, for "gpu" (CUDA) and "tpu": the train step (prox
pass included), the sampler's weight layout, prefill, insert and paged generate, the eval engine's
generate and the one-process weight-sync reshard, at the configs' shapes and meshes. Each target's kernels
must be in the lowered text (Triton and cuDNN on CUDA, Mosaic on TPU), and the TPU paged kernel's page
table must fit its scalar-memory budget. Lowering catches shape, BlockSpec, shard_map and wrapper errors;
device compilers, memory and speed are out of its reach (docs/distributed.md).
"""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from configs import math_8b, qwen_1p5b_math
from jaxrl_async.model import attention, presets
from jaxrl_async.run_config import memory_sections
from jaxrl_async.runtime import lowering
from jaxrl_async.sampler import Engine, SamplerConfig, paged
from jaxrl_async.sharding import make_mesh

LAYOUTS = {
    "math_8b": (lambda: math_8b.get_config(), "qwen3-8b"),
    "math_8b:h100": (lambda: math_8b.get_config("h100"), "qwen3-8b"),
    "qwen_1p5b_math": (qwen_1p5b_math.get_config, "qwen2.5-1.5b"),
}
# Every program a run executes (and the weight sync's cuts, "weight_sync/cut <device>").
PROGRAMS = ("train/accumulate", "train/apply", "train/logprobs", "sampler/to_layout", "sampler/prefill",
            "sampler/insert", "sampler/generate", "eval/generate")  # fmt: skip
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The programs that must hold the target's attention kernels.
KERNELS = {
    "tpu": {name: lowering.MOSAIC for name in ("train/accumulate", "train/logprobs", "sampler/prefill",
                                                "sampler/generate", "eval/generate")},  # fmt: skip
    # cuDNN runs under custom partitioning on a sharded mesh: its call is the partitioner's until XLA
    # partitions the program (`test_cudnn_is_the_gpu_attention_at_the_trainer_row_shape` shows the call).
    "gpu": {"sampler/generate": lowering.TRITON, "eval/generate": lowering.TRITON,
            "train/accumulate": ("CustomSPMDPartitioning",), "train/logprobs": ("CustomSPMDPartitioning",),
            "sampler/prefill": ("CustomSPMDPartitioning",)},  # fmt: skip
}


@pytest.fixture
def cudnn_as_on_an_h100(monkeypatch):
    """jax's cuDNN wrapper asks the local GPU for its cuDNN version and compute capability before it emits
    the call; a CPU-only jaxlib has neither. These are an H100's answers (cuDNN 9.8, capability 9.0)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 90800)
    monkeypatch.setattr(fa, "check_compute_capability", lambda c: tuple(map(int, c.split("."))) <= (9, 0))


def _lower(layout: str, platform: str):
    get_config, preset = LAYOUTS[layout]
    c = get_config()
    if (layout, platform) == ("math_8b", "tpu"):  # its v5p splits decode over both cores of a chip; "auto"
        c.sampler.megacore = "kv_head"  # picks this there (asserted below), and one core here on CPU devices
    m = c.model
    model = presets.get(preset, dtype=m.dtype, param_dtype=m.param_dtype, attention=m.attention)
    sections = memory_sections(c.to_dict())
    return lowering.lower_programs(
        model, sections["trainer"], sections["sampler"], tuple(c.mesh.sampler), tuple(c.mesh.trainer),
        platform, c.eval_slots,
    )  # fmt: skip


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_program_of_the_flagship_layouts_lowers_for_the_target_with_its_kernels(
    layout, platform, cudnn_as_on_an_h100, request
):
    c = LAYOUTS[layout][0]()
    needed = max(c.mesh.trainer[0] * c.mesh.trainer[1], c.mesh.sampler[0] * c.mesh.sampler[1])
    if needed > jax.device_count():  # math_8b's 16-chip trainer: this case again, with enough fake devices
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={needed}")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid]
        run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout[-4000:] + run.stderr[-2000:]
        return
    out = _lower(layout, platform)
    programs = out["programs"]
    missing = [name for name in PROGRAMS if name not in programs]
    assert not missing, f"{layout} on {platform}: not lowered: {missing}"
    assert any(name.startswith("weight_sync/cut") for name in programs)
    for name, calls in KERNELS[platform].items():
        found = lowering.custom_calls(programs[name])
        assert lowering.has_call(found, calls), f"{layout} {name} on {platform}: {calls} not in {found}"
    wrong = lowering.MOSAIC if platform == "gpu" else lowering.TRITON
    for name, lowered in programs.items():  # nothing of the other target's kernels
        assert not lowering.has_call(lowering.custom_calls(lowered), wrong), name
    engines = out["engines"]
    for role in ("sampler", "eval"):
        assert engines[role].paged and engines[role].spec.cache.layout.impl == platform
        assert not engines[role].spec.cache.layout.interpret
    if platform == "tpu":
        for role in ("sampler", "eval"):
            smem = lowering.paged_table_smem_bytes(engines[role])
            assert smem <= paged.SMEM_TABLE_SHARE * paged.TPU_SMEM_BYTES, (layout, role, smem)
            lay, cfg = engines[role].spec.cache.layout, engines[role].cfg
            heads = lay.n_kv_heads // (lay.mesh.shape[lay.heads] if lay.heads else 1)
            on_v5p = paged.megacore_mode("auto", "TPU v5p", heads, cfg.num_slots // lay.data)
            assert lay.megacore == (on_v5p if layout == "math_8b" else None), (layout, role, lay.megacore)
            kernels = lowering.mosaic_grids(programs[f"{role}/generate"])
            grids = [grid for name, grid in kernels if name.startswith("paged_flash_attention")]
            assert grids and all(g[0] == (2 if lay.megacore else 1) for g in grids), (layout, role, kernels)


def test_cudnn_is_the_gpu_attention_at_the_trainer_row_shape(cudnn_as_on_an_h100):
    """On one device (no partitioner in the way) the trainer's packed attention at the :h100 layout's
    per-device shape lowers to cuDNN's fused attention, forward and backward."""
    c = math_8b.get_config("h100")
    model = presets.get("qwen3-8b", platform="gpu")
    fsdp, tensor = c.mesh.trainer
    rows, t = c.trainer.rows_per_micro // fsdp, c.trainer.token_budget
    q = jax.ShapeDtypeStruct((rows, t, model.n_heads // tensor, model.head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((rows, t, model.n_kv_heads // tensor, model.head_dim), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((rows, t), jnp.int32)

    def loss(q, k, v, seg):
        return jnp.sum(attention.attend("auto", q, k, v, seg, platform="gpu").astype(jnp.float32))

    traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv, seg)
    lowered = traced.lower(lowering_platforms=("cuda",))
    calls = lowering.custom_calls(lowered)
    assert {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"} <= calls, calls


def test_kernel_choice_follows_the_configured_platform_not_the_cpu_it_is_built_on():
    mesh = make_mesh((1, 1), ("data", "tensor"), jax.devices()[:1])
    cfg = SamplerConfig(num_slots=4, max_prompt_len=16, max_new_tokens=16)
    for platform, impl in (("gpu", "gpu"), ("tpu", "tpu")):
        eng = Engine(presets.tiny(platform=platform), None, mesh, cfg)
        assert eng.kernel_choice.attention == "paged_kernel"
        assert (eng.spec.cache.layout.impl, eng.spec.cache.layout.interpret) == (impl, False)
    eng = Engine(presets.tiny(), None, mesh, cfg)  # "": the devices' own platform, here the CPU
    assert eng.kernel_choice.attention == "xla" and not eng.paged
    assert attention.target("") == jax.default_backend() and attention.target("cuda") == "gpu"
    with pytest.raises(ValueError, match="ModelConfig.platform"):
        presets.tiny(platform="cuda12")


def test_a_tpu_page_table_over_the_scalar_memory_budget_is_refused_naming_the_field():
    """math_8b's replica holds 64 slots of 28,672 positions per data shard (a 448 KiB table per call); 128
    would be 896 KiB, over half of the 1 MiB of scalar memory."""
    mesh = make_mesh((1, 1), ("data", "tensor"), jax.devices()[:1])
    model = presets.get("qwen3-8b", dtype="bfloat16", param_dtype="bfloat16", platform="tpu")
    cfg = SamplerConfig(num_slots=64, max_prompt_len=1024, max_new_tokens=27648, attention="paged_kernel")
    eng = Engine(model, None, mesh, cfg)
    assert lowering.paged_table_smem_bytes(eng) == 64 * (1792 + 1) * 4
    big = SamplerConfig(num_slots=128, max_prompt_len=1024, max_new_tokens=27648, attention="paged_kernel")
    with pytest.raises(ValueError, match=re.escape("SamplerConfig.num_slots=128")):
        Engine(model, None, mesh, big)


def test_the_ragged_tpu_kernel_lowers_at_math_8b_and_writes_the_pools_in_place():
    """math_8b's v5p replica (tensor 4: 2 KV heads a shard, 64 slots of 28,672 positions) decoding with
    paged_tpu_kernel="ragged": generate lowers for tpu with one ragged kernel a layer, split over the two
    cores by KV head. Each call declares its pool operands (7 and 8) aliased to its pool outputs, those
    operands come straight from the program's arguments, which are donated, and the program holds no
    scatter (the JAX kernel's path scatters each layer's new K/V into both pools), so nothing copies a pool
    before XLA's own buffer assignment, which only a TPU compile can show. Its scalar-prefetched arrays fit
    the budget."""
    c = math_8b.get_config()
    c.sampler.megacore, c.sampler.paged_tpu_kernel = "kv_head", "ragged"
    m = c.model
    model = presets.get("qwen3-8b", dtype=m.dtype, param_dtype=m.param_dtype, attention=m.attention)
    model = model.replace(platform="tpu")
    data, tensor = c.mesh.sampler
    mesh = make_mesh((data, tensor), ("data", "tensor"), jax.devices()[: data * tensor])
    eng = Engine(model.compute_copy(), None, mesh, memory_sections(c.to_dict())["sampler"])
    lay = eng.spec.cache.layout
    assert (lay.tpu_kernel, lay.megacore) == ("ragged", "kv_head")
    assert lowering.paged_table_smem_bytes(eng) <= paged.SMEM_TABLE_SHARE * paged.TPU_SMEM_BYTES
    lowered = eng.lower_for(("tpu",))["generate"]
    text, kernels = lowered.as_text(), lowering.mosaic_grids(lowered)
    assert len(kernels) == model.n_layers, kernels[:2]
    assert all(name == "ragged_paged_attention" and grid == (2, 1, 64) for name, grid in kernels), kernels[:2]
    calls = re.findall(r"custom_call @tpu_custom_call\(([^)]*)\)(.*)", text)
    assert len(calls) == model.n_layers
    for operands, attrs in calls:
        pools = [a.strip() for a in operands.split(",")][7:9]
        assert all(re.fullmatch(r"%arg\d+", p) for p in pools), pools
        for out, operand in ((1, 7), (2, 8)):
            alias = f"output_tuple_indices = [{out}], operand_index = {operand},"
            assert alias in attrs, attrs[:400]
    assert "stablehlo.scatter" not in text
    signature = text.split("func.func public @main(", 1)[1].split(") -> (", 1)[0]
    pool_type = "tensor<{}xbf16>".format("x".join(map(str, lay.pool_shape)))
    pool_args = [a for a in signature.split("%arg")[1:] if a.split(": ", 1)[1].startswith(pool_type)]
    assert len(pool_args) == 2 * model.n_layers and all("tf.aliasing_output" in a for a in pool_args)
