"""Will this config fit? Compile its train step and decode step for the target meshes on fake CPU devices.

  python tools/plan_check.py --config configs/math_8b.py:h100 --preset qwen3-8b --hardware h100
  python tools/plan_check.py --config configs/math_8b.py --preset llama-3.1-8b --hardware tpu-v5p

The model shape comes from `--preset` or from `--hf-config PATH/config.json` (no weights are read).
Prints JSON with per-device bytes and whether they fit the hardware's memory, and the paged KV cache an
accelerator sampler gets in the memory left beside the compiled decode step's weights and temporaries:
pages per device and the sequences that run at once (full length, and a long-tailed length mix:
--median-len, --p99-len, --prompt-len; the group size is the config's samples_per_prompt).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_config(spec: str):
    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("plan_config", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="configs/x.py[:arg]")
    p.add_argument("--preset", default="", help="model shape preset (jaxrl_async.model.presets)")
    p.add_argument("--hf-config", default="", help="an HF config.json giving the model shape")
    p.add_argument("--hardware", default="h100", help="memory per device from jaxrl_async.perf presets")
    p.add_argument("--out", default="")
    p.add_argument("--median-len", type=float, default=512, help="paged KV plan: median response length")
    p.add_argument("--p99-len", type=float, default=4096, help="paged KV plan: 99th percentile length")
    p.add_argument("--prompt-len", type=int, default=256, help="paged KV plan: typical prompt length")
    args = p.parse_args()

    config = load_config(args.config)
    n = config.mesh.sampler[0] * config.mesh.sampler[1] + config.mesh.trainer[0] * config.mesh.trainer[1]
    import jax

    jax.config.update("jax_num_cpu_devices", n)
    jax.config.update("jax_platforms", "cpu")

    from jaxrl_async.model import from_hf_config, presets
    from jaxrl_async.perf.hardware import get_hardware
    from jaxrl_async.perf.plan_check import paged_kv_plan, plan_check
    from jaxrl_async.run_config import SECTIONS, _section

    dtype = config.model.dtype
    if args.hf_config:
        with open(args.hf_config) as f:
            model_cfg = from_hf_config(json.load(f), dtype=dtype)
    else:
        model_cfg = presets.get(args.preset or config.model.preset, dtype=dtype, param_dtype=dtype)
    train_cfg = _section("trainer", SECTIONS["trainer"], dict(config.trainer.to_dict()))
    sampler_cfg = _section("sampler", SECTIONS["sampler"], dict(config.sampler.to_dict()))
    hw = get_hardware(args.hardware)
    report = plan_check(model_cfg, train_cfg, sampler_cfg, config.mesh)
    gib = 2**30
    report["hardware"] = {"name": hw.name, "mem_bytes": hw.mem_bytes}
    report["fits"] = {
        "trainer": report["trainer"]["peak_estimate"] <= hw.mem_bytes,
        "sampler": report["sampler"]["peak_accelerator"] <= hw.mem_bytes,
    }
    sa = report["sampler"]
    not_kv = sa["peak_accelerator"] - sa["analytic"]["kv_cache"]  # weights + decode temporaries
    group = int(config.get("samples_per_prompt", 1))
    report["paged_kv"] = paged_kv_plan(
        model_cfg, sampler_cfg, tuple(config.mesh.sampler), hw.mem_bytes - not_kv,
        args.median_len, args.p99_len, group, args.prompt_len,
    )  # fmt: skip
    print(json.dumps(report, indent=2))
    tr, sa, ok = report["trainer"], report["sampler"], report["fits"]
    verdict = lambda fits: "fits" if fits else "DOES NOT FIT"
    print(f"\nper device, {hw.name} has {hw.mem_bytes / gib:.0f} GiB")
    print(
        f"  trainer {config.mesh.trainer}: args {tr['argument_size'] / gib:.2f} GiB, temps "
        f"{tr['temp_size'] / gib:.2f} GiB, peak ~{tr['peak_estimate'] / gib:.2f} GiB "
        f"-> {verdict(ok['trainer'])}"
    )
    an = sa["analytic"]
    print(
        f"  sampler {config.mesh.sampler}: args {sa['argument_size'] / gib:.2f} GiB (analytic: weights "
        f"{an['weights'] / gib:.2f} + KV cache {an['kv_cache'] / gib:.2f}), temps "
        f"{sa['temp_size_accelerator'] / gib:.2f} GiB (XLA:CPU {sa['temp_size'] / gib:.2f}), "
        f"peak ~{sa['peak_accelerator'] / gib:.2f} GiB -> {verdict(ok['sampler'])}"
    )
    pk = report["paged_kv"]
    print(
        f"  paged KV ({pk['page_size']}-position pages of {pk['page_bytes'] / 2**20:.2f} MiB per device, in "
        f"the {pk['free_bytes'] / gib:.2f} GiB left beside weights and decode temporaries): "
        f"{pk['pages_per_device']} pages per device; concurrent sequences: {pk['sequences_at_max_len']} at "
        f"max_prompt_len + max_new_tokens = {sampler_cfg.max_seq_len}, {pk['sequences_long_tail']} on a "
        f"long tail (prompt {args.prompt_len}, median {args.median_len:.0f}, p99 {args.p99_len:.0f}, group "
        f"{group}) vs {pk['sequences_slotted']} for the slotted cache; num_slots={sampler_cfg.num_slots} "
        f"caps the decode batch at {pk['decode_batch_long_tail']}"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
