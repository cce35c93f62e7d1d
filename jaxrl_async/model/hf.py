"""Hugging Face checkpoints: load straight into a target sharding, one tensor at a time; export back.

Safetensors files are read through their header and a memory map, so each device shard reads only its own
slice of each tensor and the full model is never built on one device.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable

import jax
import ml_dtypes
import numpy as np

from jaxrl_async import storage
from jaxrl_async.model.config import ModelConfig, from_hf_config, to_hf_config
from jaxrl_async.model.params import ParamSpec, param_shardings, param_specs
from jaxrl_async.sharding import Rules

_ST_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


class SafetensorsDir:
    """Lazy, memory-mapped access to every tensor of a (single or sharded) safetensors checkpoint."""

    def __init__(self, path: str):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors files")
        self.entries: dict[str, tuple[str, str, tuple[int, ...], int, int]] = {}
        for name in files:
            fpath = os.path.join(path, name)
            with open(fpath, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            for key, meta in header.items():
                if key == "__metadata__":
                    continue
                start, end = meta["data_offsets"]
                self.entries[key] = (fpath, meta["dtype"], tuple(meta["shape"]), 8 + n + start, 8 + n + end)
        self._maps: dict[str, np.memmap] = {}

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def shape(self, key: str) -> tuple[int, ...]:
        return self.entries[key][2]

    def get(self, key: str) -> np.ndarray:
        """The tensor as a read-only memory-mapped array (no bytes read until sliced)."""
        fpath, dtype, shape, start, end = self.entries[key]
        if dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {key!r}: unsupported safetensors dtype {dtype}")
        if fpath not in self._maps:
            self._maps[fpath] = np.memmap(fpath, dtype=np.uint8, mode="r")
        return self._maps[fpath][start:end].view(_ST_DTYPES[dtype]).reshape(shape)


def write_safetensors(path: str, tensors: dict[str, Callable[[], np.ndarray]], shapes, dtypes) -> None:
    """Streams tensors into one safetensors file; `tensors[name]()` is called once, just before writing."""
    header, offset = {}, 0
    for name in tensors:
        nbytes = int(np.prod(shapes[name], dtype=np.int64)) * np.dtype(dtypes[name]).itemsize
        header[name] = {
            "dtype": _ST_NAMES[np.dtype(dtypes[name])],
            "shape": list(shapes[name]),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, make in tensors.items():
            arr = np.ascontiguousarray(make(), dtype=dtypes[name])
            if arr.shape != tuple(shapes[name]):
                raise ValueError(f"tensor {name!r}: shape {arr.shape}, expected {tuple(shapes[name])}")
            f.write(arr.tobytes())


# Each of our leaves <- HF tensor(s): (HF name template, HF shape, to_ours, to_hf). `{l}` = layer index.
def _hf_layout(cfg: ModelConfig) -> dict[str, tuple]:
    D, H, G, K, F, V = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffw_size, cfg.vocab_size
    a = "model.layers.{l}.self_attn."
    m = "model.layers.{l}.mlp."
    ident = (lambda x: x, lambda x: x)
    lin = lambda *out: (lambda x: x.T.reshape(out), lambda x: x.reshape(x.shape[0], -1).T)
    o_map = (lambda x: x.T.reshape(H, K, D), lambda x: x.reshape(H * K, D).T)
    flat = lambda *out: (lambda x: x.reshape(out), lambda x: x.reshape(-1))
    lay = {
        "embed": ("model.embed_tokens.weight", (V, D), *ident),
        "final_norm": ("model.norm.weight", (D,), *ident),
        "layers/attn_norm": ("model.layers.{l}.input_layernorm.weight", (D,), *ident),
        "layers/mlp_norm": ("model.layers.{l}.post_attention_layernorm.weight", (D,), *ident),
        "layers/q": (a + "q_proj.weight", (H * K, D), *lin(D, H, K)),
        "layers/k": (a + "k_proj.weight", (G * K, D), *lin(D, G, K)),
        "layers/v": (a + "v_proj.weight", (G * K, D), *lin(D, G, K)),
        "layers/o": (a + "o_proj.weight", (D, H * K), *o_map),
        "layers/gate": (m + "gate_proj.weight", (F, D), lambda x: x.T, lambda x: x.T),
        "layers/up": (m + "up_proj.weight", (F, D), lambda x: x.T, lambda x: x.T),
        "layers/down": (m + "down_proj.weight", (D, F), lambda x: x.T, lambda x: x.T),
        "layers/q_bias": (a + "q_proj.bias", (H * K,), *flat(H, K)),
        "layers/k_bias": (a + "k_proj.bias", (G * K,), *flat(G, K)),
        "layers/v_bias": (a + "v_proj.bias", (G * K,), *flat(G, K)),
        "layers/o_bias": (a + "o_proj.bias", (D,), *ident),
        "layers/q_norm": (a + "q_norm.weight", (K,), *ident),
        "layers/k_norm": (a + "k_norm.weight", (K,), *ident),
        "lm_head": ("lm_head.weight", (V, D), lambda x: x.T, lambda x: x.T),
    }
    return lay


def _flat_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    specs = param_specs(cfg)
    out = {k: v for k, v in specs.items() if k != "layers"}
    out.update({f"layers/{k}": v for k, v in specs["layers"].items()})
    return out


def _unflatten(flat: dict) -> dict:
    out: dict = {"layers": {}}
    for k, v in flat.items():
        if k.startswith("layers/"):
            out["layers"][k[len("layers/") :]] = v
        else:
            out[k] = v
    return out


def _hf_names(template: str, stacked: bool, n_layers: int) -> list[str]:
    return [template.format(l=i) for i in range(n_layers)] if stacked else [template]


def load_hf(
    path: str,
    dtype: str = "float32",
    mesh=None,
    rules: Rules | None = None,
    param_dtype: str = "float32",
    attention: str = "auto",
):
    """Loads an HF checkpoint directory (a gs:// one is first copied to this host, `storage.local_dir`).

    Args:
      path: directory with config.json and *.safetensors (optionally model.safetensors.index.json).
      dtype: "float32" or "bfloat16": the compute dtype.
      mesh, rules: place each tensor directly into this role's sharding (default: the default device).
      param_dtype: dtype the weights are stored in: "float32" master weights for training (whatever the
        checkpoint's dtype), or the compute dtype for a model that only samples.
      attention: ModelConfig.attention.

    Returns:
      (ModelConfig, params) with params in the layout of `param_specs`.

    Raises:
      ValueError / FileNotFoundError naming the missing file, tensor or field, or the mismatched shape.
    """
    path = storage.local_dir(path)
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"{path}: no config.json")
    with open(cfg_path) as f:
        cfg = from_hf_config(json.load(f), dtype=dtype, param_dtype=param_dtype, attention=attention)
    st = SafetensorsDir(path)
    layout, specs = _hf_layout(cfg), _flat_specs(cfg)
    for key in specs:  # validate every tensor before reading any
        template, hf_shape = layout[key][:2]
        for name in _hf_names(template, key.startswith("layers/"), cfg.n_layers):
            if name not in st:
                raise ValueError(f"{path}: missing tensor {name!r} (needed for {key})")
            if st.shape(name) != hf_shape:
                raise ValueError(f"{path}: tensor {name!r} has shape {st.shape(name)}, expected {hf_shape}")
    shardings = None if mesh is None else _flat_from_tree(param_shardings(cfg, mesh, rules))
    flat = {}
    for key, spec in specs.items():
        template, _, to_ours, _ = layout[key]
        np_dtype = np.dtype(ml_dtypes.bfloat16) if spec.dtype == "bfloat16" else np.dtype(spec.dtype)
        if key.startswith("layers/"):

            def read(idx, template=template, to_ours=to_ours, np_dtype=np_dtype):
                layers = range(cfg.n_layers)[idx[0]]
                parts = [to_ours(st.get(template.format(l=i)))[idx[1:]] for i in layers]
                return np.stack(parts).astype(np_dtype)
        else:

            def read(idx, template=template, to_ours=to_ours, np_dtype=np_dtype):
                return np.ascontiguousarray(to_ours(st.get(template))[idx]).astype(np_dtype)

        sharding = (
            jax.sharding.SingleDeviceSharding(jax.local_devices()[0]) if shardings is None else shardings[key]
        )
        flat[key] = jax.make_array_from_callback(spec.shape, sharding, read, dtype=np_dtype)
    return cfg, _unflatten(flat)


def _flat_from_tree(tree: dict) -> dict:
    out = {k: v for k, v in tree.items() if k != "layers"}
    out.update({f"layers/{k}": v for k, v in tree["layers"].items()})
    return out


def _to_host(x) -> np.ndarray:
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def save_hf(
    cfg: ModelConfig,
    params: dict,
    path: str,
    tokenizer_dir: str | None = None,
    max_shard_bytes: int = 4 << 30,
) -> None:
    """Exports params as HF safetensors + config.json (one host tensor at a time; process 0 writes).

    Args:
      cfg, params: the model.
      path: output directory (created).
      tokenizer_dir: copy tokenizer files from here, if given.
      max_shard_bytes: split into several files with an index beyond this size.
    """
    hf_config = to_hf_config(cfg)  # fails before anything is written when no HF config represents cfg
    layout, flat = _hf_layout(cfg), _flat_from_tree(params)
    dtype = ml_dtypes.bfloat16 if cfg.param_dtype == "bfloat16" else np.float32
    tensors, shapes = {}, {}
    for key, leaf in flat.items():
        template, hf_shape, _, to_hf = layout[key]
        stacked = key.startswith("layers/")
        for i, name in enumerate(_hf_names(template, stacked, cfg.n_layers)):
            get = (
                (lambda leaf=leaf, i=i, to_hf=to_hf: to_hf(_to_host(leaf[i])))
                if stacked
                else (lambda leaf=leaf, to_hf=to_hf: to_hf(_to_host(leaf)))
            )
            tensors[name], shapes[name] = get, hf_shape
    if jax.process_index() != 0:
        for get in tensors.values():  # other processes still join the all-gathers
            get()
        return
    os.makedirs(path, exist_ok=True)
    itemsize = np.dtype(dtype).itemsize
    shards, current, size = [], {}, 0
    for name, get in tensors.items():
        nbytes = int(np.prod(shapes[name])) * itemsize
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name], size = get, size + nbytes
    shards.append(current)
    dtypes = dict.fromkeys(tensors, dtype)
    if len(shards) == 1:
        write_safetensors(os.path.join(path, "model.safetensors"), shards[0], shapes, dtypes)
    else:
        weight_map = {}
        for j, shard in enumerate(shards):
            fname = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(os.path.join(path, fname), shard, shapes, dtypes)
            weight_map.update(dict.fromkeys(shard, fname))
        total = sum(int(np.prod(s)) * itemsize for s in shapes.values())
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    if tokenizer_dir:
        for name in TOKENIZER_FILES:
            src = os.path.join(tokenizer_dir, name)
            if os.path.exists(src) and os.path.abspath(src) != os.path.abspath(os.path.join(path, name)):
                shutil.copy(src, os.path.join(path, name))
