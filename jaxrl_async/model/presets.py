"""Model shape presets. Weights for the large ones come from the user's local HF checkpoint."""

from __future__ import annotations

from jaxrl_async.model.config import ModelConfig, RopeScaling


def tiny(vocab_size: int = 128, **kw) -> ModelConfig:
    """A ~0.4M-parameter model for CPU demos and tests (character vocabulary)."""
    base = dict(
        vocab_size=vocab_size,
        d_model=128,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        ffw_size=384,
        max_seq_len=256,
        rope_theta=10000.0,
    )
    base.update(kw)
    return ModelConfig(**base)


def llama_100m(**kw) -> ModelConfig:
    """A ~100M-parameter Llama used by the CPU benchmarks."""
    base = dict(
        vocab_size=32000,
        d_model=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=12,
        head_dim=64,
        ffw_size=2048,
        max_seq_len=2048,
        rope_theta=500000.0,
    )
    base.update(kw)
    return ModelConfig(**base)


def qwen2p5_0p5b(**kw) -> ModelConfig:
    base = dict(
        vocab_size=151936,
        d_model=896,
        n_layers=24,
        n_heads=14,
        n_kv_heads=2,
        head_dim=64,
        ffw_size=4864,
        rms_eps=1e-6,
        rope_theta=1000000.0,
        tie_embeddings=True,
        qkv_bias=True,
        max_seq_len=32768,
        arch="qwen2",
        eos_token_id=151643,
    )
    base.update(kw)
    return ModelConfig(**base)


def qwen2p5_1p5b(**kw) -> ModelConfig:
    base = dict(
        vocab_size=151936,
        d_model=1536,
        n_layers=28,
        n_heads=12,
        n_kv_heads=2,
        head_dim=128,
        ffw_size=8960,
        rms_eps=1e-6,
        rope_theta=1000000.0,
        tie_embeddings=True,
        qkv_bias=True,
        max_seq_len=32768,
        arch="qwen2",
        eos_token_id=151643,
    )
    base.update(kw)
    return ModelConfig(**base)


def llama3p1_8b(**kw) -> ModelConfig:
    base = dict(
        vocab_size=128256,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        ffw_size=14336,
        rms_eps=1e-5,
        rope_theta=500000.0,
        max_seq_len=131072,
        arch="llama",
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
        bos_token_id=128000,
        eos_token_id=128001,
    )
    base.update(kw)
    return ModelConfig(**base)


def qwen3_8b(**kw) -> ModelConfig:
    base = dict(
        vocab_size=151936,
        d_model=4096,
        n_layers=36,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        ffw_size=12288,
        rms_eps=1e-6,
        rope_theta=1000000.0,
        qk_norm=True,
        max_seq_len=40960,
        arch="qwen3",
        eos_token_id=151645,
    )
    base.update(kw)
    return ModelConfig(**base)


PRESETS = {
    "tiny": tiny,
    "llama_100m": llama_100m,
    "qwen2.5-0.5b": qwen2p5_0p5b,
    "qwen2.5-1.5b": qwen2p5_1p5b,
    "llama-3.1-8b": llama3p1_8b,
    "qwen3-8b": qwen3_8b,
}


def get(name: str, **kw) -> ModelConfig:
    """A preset by name; unknown names fail listing the known ones."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name](**kw)
