"""LoRA checkpoints and export: a resume restores adapters and AdamW state exactly (the next step is
bit-identical); the merged export and the PEFT adapter directory give our logits in transformers/peft."""

import dataclasses
import importlib.util

import host_caps
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.model import forward_logits, init_params, presets, save_hf
from jaxrl_async.model import lora as lora_lib
from jaxrl_async.model.lora_hf import save_peft
from jaxrl_async.rollouts import Rollout
from jaxrl_async.runtime.checkpoint import RunCheckpoints, load_policy, write_model_info
from jaxrl_async.runtime.lora_checkpoint import save_base
from jaxrl_async.sharding import SAMPLER_RULES, make_mesh
from jaxrl_async.trainer import TrainConfig, create_train_state, prepare_batch, train_step
from jaxrl_async.trainer.adapters import model_params

MODEL = presets.tiny(vocab_size=64, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffw_size=128)
LORA = lora_lib.LoraConfig(enabled=True, rank=4, alpha=8.0, targets=("q", "v", "o", "up", "down"))
CFG = TrainConfig(lr=1e-2, token_budget=48, rows_per_micro=8, minibatches=2, lora=LORA)


def rollouts(seed):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(16):
        p, c = int(rng.integers(1, 12)), int(rng.integers(1, 20))
        behav = -4.2 + 0.3 * rng.normal(size=c)
        out.append(Rollout.for_trainer(rng.integers(0, 64, p), rng.integers(0, 64, c), behav, [0] * c,
                                       float(i % 2), i // 4))  # fmt: skip
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A LoRA state after two steps, checkpointed (adapters + optimizer; the base once, beside)."""
    params = init_params(MODEL, jax.random.key(0))
    state = create_train_state(CFG, MODEL, params, adapter_key=jax.random.key(7))
    for seed in (0, 1):
        state, _ = train_step(state, prepare_batch(CFG, rollouts(seed)))
    directory = str(tmp_path_factory.mktemp("lora") / "checkpoints")
    ckpts = RunCheckpoints(directory)
    write_model_info(directory, MODEL, "char")
    save_base(directory, LORA, state.frozen, "init seed 0")
    ckpts.save(2, state, {"cursor": 2}, wait=True)
    ckpts.close()
    return params, state, directory


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_resume_restores_adapters_and_optimizer_exactly(trained):
    params, state, directory = trained
    fresh = create_train_state(CFG, MODEL, params, adapter_key=jax.random.key(99))  # other adapters
    ckpts = RunCheckpoints(directory)
    resumed, version, coordinator = ckpts.restore_latest(fresh)
    ckpts.close()
    assert version == 2 and coordinator == {"cursor": 2} and int(resumed.version) == 2
    for a, b in zip(leaves((state.params, state.opt_state)), leaves((resumed.params, resumed.opt_state)),
                    strict=True):  # fmt: skip
        np.testing.assert_array_equal(a, b)
    batch = prepare_batch(CFG, rollouts(2))
    copy = jax.tree.map(jnp.copy, state)  # the step donates its state: keep the fixture's
    (a, _), (b, _) = train_step(copy, batch), train_step(resumed, batch)
    for x, y in zip(leaves(a.params), leaves(b.params), strict=True):
        np.testing.assert_array_equal(x, y)  # the next step is bit-identical


def test_load_policy_merges_base_and_adapters(trained):
    _, state, directory = trained
    mesh = make_mesh((1, 1), ("data", "tensor"), jax.devices()[:1])
    cfg, merged, tokenizer, version = load_policy(directory, mesh, SAMPLER_RULES)
    assert (cfg, tokenizer, version) == (MODEL, "char", 2)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 64, (2, 9)), jnp.int32)
    want = np.asarray(forward_logits(MODEL, model_params(CFG, state.params, state.frozen), tokens))
    np.testing.assert_allclose(np.asarray(forward_logits(MODEL, merged, tokens)), want, atol=1e-4)


def test_peft_export_loads_with_equal_logits(trained, tmp_path):
    if importlib.util.find_spec("peft") is None:
        host_caps.skip("peft", "peft is not installed")
    import peft
    import torch
    import transformers

    _, state, _ = trained
    base_dir, adapter_dir = str(tmp_path / "base"), str(tmp_path / "adapter")
    save_hf(MODEL, state.frozen, base_dir)
    save_peft(MODEL, LORA, state.params, adapter_dir, base_model=base_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    tokens = np.random.default_rng(4).integers(0, 64, (2, 9))
    with torch.no_grad():
        theirs = model(torch.as_tensor(tokens)).logits.numpy()
    ours = np.asarray(forward_logits(MODEL, model_params(CFG, state.params, state.frozen), tokens))
    assert np.abs(ours - np.asarray(forward_logits(MODEL, state.frozen, tokens))).max() > 1e-3
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=1e-4)
    merged_dir = str(tmp_path / "merged")
    save_hf(MODEL, lora_lib.merge(state.frozen, state.params, LORA), merged_dir)
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        np.testing.assert_allclose(merged(torch.as_tensor(tokens)).logits.numpy(), ours, atol=1e-4, rtol=1e-4)
    assert dataclasses.asdict(LORA)["rank"] == 4
