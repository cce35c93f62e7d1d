"""Model invariants and Hugging Face parity (tiny random checkpoints saved by transformers in the test)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.model import (
    forward,
    forward_logits,
    from_hf_config,
    init_params,
    load_hf,
    param_specs,
    presets,
    save_hf,
)
from jaxrl_async.sharding import SAMPLER_RULES, TRAINER_RULES, Rules, make_mesh


def _torch_and_transformers():
    """Imported by the tests that compare with transformers only, not at module level: the jax 0.11 stage
    of .ci/run installs neither, and runs every other test of this file."""
    return pytest.importorskip("torch"), pytest.importorskip("transformers")


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.2,
    rms_norm_eps=1e-6,
)

CASES = {
    "llama_gqa_rope_scaling_untied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(rope_parameters={"rope_theta": 10000.0, **LLAMA3_ROPE}, tie_word_embeddings=False),
    ),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, num_key_value_heads=4)),
    "qwen2_bias_tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3_qknorm_untied": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False, head_dim=24)),
}


def _make_hf(tmp_path, case):
    torch, transformers = _torch_and_transformers()
    cfg_cls, model_cls, extra = CASES[case]
    torch.manual_seed(0)
    hf_cfg = getattr(transformers, cfg_cls)(**{**COMMON, **extra})
    model = getattr(transformers, model_cls)(hf_cfg).eval()
    with torch.no_grad():  # norms and biases start at 1/0: perturb so parity checks them
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.3 * torch.randn_like(p))
    path = str(tmp_path / case)
    model.save_pretrained(path)
    return model, path


def _tokens(b=2, t=11, v=97, seed=0):
    return np.random.default_rng(seed).integers(0, v, size=(b, t)).astype(np.int32)


def _hf_logits(model, tokens):
    torch, _ = _torch_and_transformers()
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_parity_and_export_roundtrip(tmp_path, case):
    model, path = _make_hf(tmp_path, case)
    cfg, params = load_hf(path)
    tokens = _tokens()
    ref = _hf_logits(model, tokens)
    ours = np.asarray(forward_logits(cfg, params, tokens))
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)

    out = str(tmp_path / (case + "_export"))
    save_hf(cfg, params, out)
    reloaded = _torch_and_transformers()[1].AutoModelForCausalLM.from_pretrained(out).eval()
    np.testing.assert_allclose(_hf_logits(reloaded, tokens), ref, atol=1e-4, rtol=0)
    cfg2, params2 = load_hf(out)
    assert cfg2 == cfg
    np.testing.assert_allclose(np.asarray(forward_logits(cfg2, params2, tokens)), ours, atol=1e-6)


def test_sharded_index_export_and_load_into_mesh(tmp_path):
    model, path = _make_hf(tmp_path, "llama_gqa_rope_scaling_untied")
    cfg, params = load_hf(path)
    out = str(tmp_path / "sharded")
    save_hf(cfg, params, out, max_shard_bytes=40_000)
    files = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    assert len(files) > 1 and os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    mesh = make_mesh((2, 4), ("fsdp", "tensor"))
    cfg2, sharded = load_hf(out, mesh=mesh, rules=TRAINER_RULES)
    assert sharded["layers"]["q"].sharding.spec == TRAINER_RULES.spec(
        ("layers", "embed", "q_heads", "head_dim")
    )
    assert len(sharded["layers"]["q"].addressable_shards) == 8
    tokens = _tokens()
    np.testing.assert_allclose(
        np.asarray(forward_logits(cfg2, sharded, tokens)), _hf_logits(model, tokens), atol=1e-4, rtol=0
    )


def test_bf16_load_close_to_fp32(tmp_path):
    model, path = _make_hf(tmp_path, "qwen3_qknorm_untied")
    cfg, params = load_hf(path, dtype="bfloat16", param_dtype="bfloat16")
    assert params["embed"].dtype == jnp.bfloat16
    assert load_hf(path, dtype="bfloat16")[1]["embed"].dtype == jnp.float32  # fp32 masters by default
    logits = np.asarray(forward_logits(cfg, params, _tokens()))
    ref = _hf_logits(model, _tokens())
    assert logits.dtype == np.float32
    # The bound from the dtype: bf16 keeps 8 significant bits, so each rounding (of a weight, or of an
    # activation entering a matmul) errs by at most eps/2 relative. Counted in series along the residual
    # path: ~8 per layer (norm, q/k/v, attention output, gate/up, down) plus the embedding and the head.
    # Measured on this case (2026-12-05): 0.13 on a largest logit of 5.9, i.e. 2.8 eps of it.
    roundings = 8 * cfg.n_layers + 2
    bound = roundings * float(jnp.finfo(jnp.bfloat16).eps) / 2 * np.abs(ref).max()
    assert np.abs(logits - ref).max() < bound


def _corrupt(path, mutate):
    from jaxrl_async.model.hf import SafetensorsDir, write_safetensors

    st = SafetensorsDir(path)
    arrays = {k: np.array(st.get(k)) for k in st.entries}
    mutate(arrays)
    os.remove(os.path.join(path, "model.safetensors"))
    write_safetensors(
        os.path.join(path, "model.safetensors"),
        {k: (lambda v=v: v) for k, v in arrays.items()},
        {k: v.shape for k, v in arrays.items()},
        {k: v.dtype for k, v in arrays.items()},
    )


def test_bad_checkpoints_name_the_problem(tmp_path):
    _, path = _make_hf(tmp_path, "llama_tied")
    _corrupt(path, lambda a: a.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf(path)

    _, path = _make_hf(tmp_path / "b", "llama_tied")
    _corrupt(path, lambda a: a.__setitem__("model.norm.weight", np.ones(63, np.float32)))
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(63,\)"):
        load_hf(path)

    _, path = _make_hf(tmp_path / "c", "llama_tied")
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    hf["architectures"], hf["model_type"] = ["MambaForCausalLM"], "mamba"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    with pytest.raises(ValueError, match="MambaForCausalLM"):
        load_hf(path)


def test_config_reads_transformers4_and_5_rope_forms():
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 16,
    }
    v4 = from_hf_config(
        {**base, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3_ROPE}}
    )
    v5 = from_hf_config({**base, "rope_parameters": {"rope_theta": 500000.0, **LLAMA3_ROPE}})
    assert v4 == v5 and v4.rope_theta == 500000.0 and v4.rope_scaling.factor == 8.0
    with pytest.raises(ValueError, match="yarn"):
        from_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="hidden_size"):
        from_hf_config({k: v for k, v in base.items() if k != "hidden_size"})


TINY = presets.tiny(vocab_size=61, n_layers=2, max_seq_len=64, qkv_bias=True, qk_norm=True)


@pytest.mark.parametrize(
    "shape,rules",
    [((2, 4), TRAINER_RULES), ((8, 1), TRAINER_RULES), ((2, 4), SAMPLER_RULES), ((1, 8), SAMPLER_RULES)],
)
def test_sharded_forward_equals_single_device(shape, rules):
    params = init_params(TINY, jax.random.key(1))
    mesh = make_mesh(shape, rules.mesh_axes)
    sharded = init_params(TINY, jax.random.key(1), mesh, rules)
    assert any(len({str(s.index) for s in x.addressable_shards}) > 1 for x in jax.tree.leaves(sharded))
    tokens = _tokens(b=8, t=9, v=61)
    np.testing.assert_allclose(
        np.asarray(forward_logits(TINY, sharded, tokens)),
        np.asarray(forward_logits(TINY, params, tokens)),
        atol=2e-5,
    )


@pytest.mark.parametrize(
    "shape,rules", [((2, 4), TRAINER_RULES), ((1, 8), SAMPLER_RULES), ((4, 2), SAMPLER_RULES)]
)
def test_local_shape_is_the_shard_each_device_holds(shape, rules):
    """The plan check's per-device bytes (`Rules.local_shape`) are the shards the rules really place,
    including a dimension the mesh axis does not divide (TINY's KV heads on a tensor axis of 4 or 8)."""
    specs = jax.tree.leaves(param_specs(TINY), is_leaf=lambda x: hasattr(x, "logical_axes"))
    params = jax.tree.leaves(init_params(TINY, jax.random.key(1), make_mesh(shape, rules.mesh_axes), rules))
    sizes = rules.mesh_sizes(shape)
    replicated = 0
    for spec, x in zip(specs, params, strict=True):
        local = rules.local_shape(spec.logical_axes, spec.shape, sizes)
        assert local == x.addressable_shards[0].data.shape, spec
        replicated += rules.placement(spec.logical_axes) != rules.placement(
            spec.logical_axes, spec.shape, sizes
        )
    assert replicated > 0  # the case the divide-or-replicate rule exists for is among them


def test_rules_reject_colliding_axes():
    rules = Rules("bad", ("fsdp", "tensor"), (("embed", "fsdp"), ("mlp", "fsdp")))
    with pytest.raises(ValueError, match="both map to mesh axis 'fsdp'"):
        rules.spec(("embed", "mlp"))
    with pytest.raises(ValueError, match="unknown mesh axis"):
        Rules("bad", ("data",), (("embed", "fsdp"),))


def test_causality_through_gradients():
    params = init_params(TINY, jax.random.key(2))
    emb_TxD = params["embed"][jnp.asarray(_tokens(b=1, t=12, v=61))[0]]
    idx = jnp.arange(12, dtype=jnp.int32)[None]

    def logit_sum_at_5(e_TxD):  # token i looks up row i of a table whose first rows are the inputs
        table = jnp.concatenate([e_TxD, params["embed"]], axis=0)
        return forward(TINY, dict(params, embed=table), idx, idx)[0, 5].sum()

    g_TxD = np.asarray(jax.grad(logit_sum_at_5)(emb_TxD))
    assert np.abs(g_TxD[6:]).max() == 0.0  # later tokens cannot change an earlier logit
    assert np.abs(g_TxD[:6]).sum(axis=-1).min() > 0.0


def test_packed_equals_separate():
    params = init_params(TINY, jax.random.key(3))
    a, b = _tokens(b=1, t=5, v=61, seed=1)[0], _tokens(b=1, t=7, v=61, seed=2)[0]
    packed = np.zeros((1, 16), np.int32)
    packed[0, :5], packed[0, 5:12] = a, b
    seg = np.zeros((1, 16), np.int32)
    seg[0, :5], seg[0, 5:12] = 1, 2
    pos = np.zeros((1, 16), np.int32)
    pos[0, :5], pos[0, 5:12] = np.arange(5), np.arange(7)
    logits = forward(TINY, params, jnp.asarray(packed), jnp.asarray(pos), segment_ids=jnp.asarray(seg))
    np.testing.assert_allclose(
        np.asarray(logits[0, :5]), np.asarray(forward_logits(TINY, params, a[None]))[0], atol=1e-5
    )
    np.testing.assert_allclose(
        np.asarray(logits[0, 5:12]), np.asarray(forward_logits(TINY, params, b[None]))[0], atol=1e-5
    )
    assert np.isfinite(np.asarray(logits)).all()


def _scale_q_heads(params, factors_H):
    """Query projections of head h multiplied by factors_H[h] (in every layer)."""
    q = params["layers"]["q"] * jnp.asarray(factors_H, jnp.float32)[None, None, :, None]
    return dict(params, layers=dict(params["layers"], q=q))


@pytest.mark.parametrize("all_heads", [False, True])
def test_qk_norm_normalizes_per_head_or_over_all_heads(all_heads):
    # Without biases a query head's scale reaches the logits only through the norm: a per-head norm removes
    # any per-head scale, the norm over all heads only a scale shared by every head.
    cfg = TINY.replace(qkv_bias=False, qk_norm_all_heads=all_heads)
    params = init_params(cfg, jax.random.key(7))
    qn = params["layers"]["q_norm"]
    assert qn.shape == ((2, 4, 32) if all_heads else (2, 32)) and cfg.num_params == sum(
        x.size for x in jax.tree.leaves(params)
    )
    rng = np.random.default_rng(0)
    params["layers"]["q_norm"] = qn * jnp.asarray(1 + 0.3 * rng.standard_normal(qn.shape), jnp.float32)
    tokens = _tokens(b=2, t=9, v=61)
    base = np.asarray(forward_logits(cfg, params, tokens))
    shared = np.asarray(forward_logits(cfg, _scale_q_heads(params, [3.0] * 4), tokens))
    one_head = np.asarray(forward_logits(cfg, _scale_q_heads(params, [3.0, 1.0, 1.0, 1.0]), tokens))
    np.testing.assert_allclose(shared, base, atol=1e-4)
    if all_heads:
        assert np.abs(one_head - base).max() > 1e-2
    else:
        np.testing.assert_allclose(one_head, base, atol=1e-4)
    with pytest.raises(ValueError, match="qk_norm_all_heads=True needs qk_norm=True"):
        TINY.replace(qk_norm=False, qk_norm_all_heads=True)


def test_qk_norm_all_heads_has_no_hf_export(tmp_path):
    cfg = presets.tiny(vocab_size=61, n_layers=1, qk_norm=True, qk_norm_all_heads=True, arch="qwen3")
    with pytest.raises(ValueError, match="qk_norm_all_heads"):
        save_hf(cfg, init_params(cfg, jax.random.key(0)), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_remat_same_gradients():
    params = init_params(TINY, jax.random.key(6))
    tokens = jnp.asarray(_tokens(b=2, t=8, v=61))
    pos = jnp.broadcast_to(jnp.arange(8), (2, 8))

    def loss(p, remat):
        return forward(TINY, p, tokens, pos, remat=remat).mean()

    g1, g2 = jax.grad(loss)(params, False), jax.grad(loss)(params, True)
    for x, y in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)


def test_presets_param_counts():
    # Published sizes: Llama-3.1-8B 8.03B, Qwen3-8B 8.19B, Qwen2.5-1.5B 1.54B, Qwen2.5-0.5B 0.49B.
    assert abs(presets.llama3p1_8b().num_params / 8.03e9 - 1) < 0.01
    assert abs(presets.qwen3_8b().num_params / 8.19e9 - 1) < 0.01
    assert abs(presets.qwen2p5_1p5b().num_params / 1.54e9 - 1) < 0.01
    assert abs(presets.qwen2p5_0p5b().num_params / 0.494e9 - 1) < 0.01
    with pytest.raises(ValueError, match="unknown model preset"):
        presets.get("gpt5")
