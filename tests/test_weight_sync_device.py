"""The one-process weight sync goes device to device: no leaf is read back to the host."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax._src.array import ArrayImpl

from jaxrl_async.model import init_params, presets
from jaxrl_async.runtime.weight_sync import WeightSync
from jaxrl_async.sharding import TRAINER_RULES, make_mesh

MODEL = presets.tiny(vocab_size=64, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffw_size=128)


@pytest.fixture
def host_reads(monkeypatch):
    """Counts `Array._value` (the host copy JAX's slow reshard path falls back to) while the test runs."""
    reads = []
    original = ArrayImpl._value

    def counted(self):
        reads.append(self.shape)
        return original.fget(self)

    monkeypatch.setattr(ArrayImpl, "_value", property(counted))
    return reads


# trainer (fsdp, tensor) on devices 0.., sampler (data, tensor) on the next ones (or the same ones)
LAYOUTS = [
    ("float32", (2, 1), (1, 2), False),
    ("bfloat16", (2, 1), (1, 2), False),
    ("bfloat16", (1, 2), (2, 2), False),  # replicated over the sampler's data axis
    ("float32", (4, 1), (1, 1), False),  # one sampler device
    ("bfloat16", (2, 1), (1, 2), True),  # both roles on the same devices
]


@pytest.mark.parametrize("dtype,trainer_shape,sampler_shape,shared", LAYOUTS)
def test_sync_makes_no_host_copy(host_reads, dtype, trainer_shape, sampler_shape, shared):
    n_t = trainer_shape[0] * trainer_shape[1]
    devices = jax.devices()
    t_mesh = make_mesh(trainer_shape, ("fsdp", "tensor"), devices[:n_t])
    first = 0 if shared else n_t
    n_s = sampler_shape[0] * sampler_shape[1]
    s_mesh = make_mesh(sampler_shape, ("data", "tensor"), devices[first : first + n_s])
    cfg = MODEL.replace(param_dtype="float32")
    masters = init_params(cfg, jax.random.key(0), t_mesh, TRAINER_RULES)
    sync = WeightSync(cfg, s_mesh, dtype=dtype)
    host_reads.clear()
    copy = sync(masters)
    copy = sync(masters)  # the cached routes too
    assert host_reads == []
    leaves = [jax.tree.leaves(t) for t in (copy, sync.shardings, masters)]
    for got, want, master in zip(*leaves, strict=True):
        assert got.sharding == want and got.dtype == jnp.dtype(dtype)
        for shard in got.addressable_shards:  # exactly the sampler's block on each sampler device
            assert shard.data.shape == want.shard_shape(got.shape)
        np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
        np.testing.assert_array_equal(np.asarray(got), np.asarray(master).astype(np_dtype))
        if shared:  # a fresh buffer, never the trainer's (its next step donates it)
            ptrs = {s.data.unsafe_buffer_pointer() for s in master.addressable_shards}
            assert not ptrs & {s.data.unsafe_buffer_pointer() for s in got.addressable_shards}


def test_plain_device_put_does_copy_through_the_host(host_reads):
    """The observable is real: JAX's own path from fsdp rows to tensor columns reads leaves on the host."""
    devices = jax.devices()
    t_mesh = make_mesh((2, 1), ("fsdp", "tensor"), devices[:2])
    s_mesh = make_mesh((1, 2), ("data", "tensor"), devices[2:4])
    masters = init_params(MODEL, jax.random.key(0), t_mesh, TRAINER_RULES)
    jax.device_put(masters, WeightSync(MODEL, s_mesh).shardings)
    assert len(host_reads) > 0
