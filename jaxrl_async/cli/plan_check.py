"""Will this config fit? Compile its train step and decode step for the target meshes on fake CPU devices.

  jaxrl-plan-check --config configs/math_8b.py:h100 --preset qwen3-8b --hardware h100
  jaxrl-plan-check --config configs/math_8b.py --preset llama-3.1-8b --hardware tpu-v5p
  jaxrl-plan-check --config configs/math_8b.py:h100 --preset qwen3-8b --hardware h100 --lora-rank 16

The model shape comes from `--preset` or from `--hf-config DIR` (an HF directory or its config.json; no
weights are read); its numerics (compute dtype, master-weight dtype, attention) from the config's `model`
section. Prints JSON with per-device bytes, the trainer state and sampler weight dtypes, and whether each
role fits.
Also the paged KV cache an accelerator sampler gets in the memory left beside the weights, the eval
engine's cache and the decode temporaries: pages per device and the sequences that run at once (full
length, and a long-tailed length mix: --median-len, --p99-len, --prompt-len; the group size is the
config's samples_per_prompt). `jaxrl-plan-check` runs the same program.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os

from absl import app, flags

from jaxrl_async.cli import hf_config_file, run_command

_CONFIG = flags.DEFINE_string("config", None, "configs/x.py[:arg]")
_PRESET = flags.DEFINE_string("preset", "", "model shape preset (jaxrl_async.model.presets)")
_HF_CONFIG = flags.DEFINE_string("hf-config", "", "an HF directory or its config.json: the model shape")
_HARDWARE = flags.DEFINE_string("hardware", "h100", "memory per device from jaxrl_async.perf presets")
_TOKEN_BUDGET = flags.DEFINE_integer("token-budget", 0, "override trainer.token_budget (row length)")
_ATTENTION = flags.DEFINE_string("attention", "", "override model.attention (e.g. reference, to compare)")
_LORA_RANK = flags.DEFINE_integer(
    "lora-rank", 0, "override config.trainer.lora: LoRA of rank N on its targets, alpha 2N (0: the config's)"
)
_OUT = flags.DEFINE_string("out", "", "also write the JSON report here")
_MEDIAN_LEN = flags.DEFINE_float("median-len", 512, "paged KV plan: median response length")
_P99_LEN = flags.DEFINE_float("p99-len", 4096, "paged KV plan: 99th percentile length")
_PROMPT_LEN = flags.DEFINE_integer("prompt-len", 256, "paged KV plan: typical prompt length")
_MEM_FRACTION = flags.DEFINE_float(
    "mem-fraction",
    None,
    "share of device memory JAX may use (default: XLA_PYTHON_CLIENT_MEM_FRACTION if "
    "set, else launch/gpu_node.sh's on a GPU, the whole memory on a TPU)",
)
_MARGIN = flags.DEFINE_float("margin", None, "least headroom, as a share of the usable memory")
_MAX_EVAL_STEPS = flags.DEFINE_float(
    "max-eval-steps", 10, "warn when one evaluation (at the mean length) costs more train steps than this"
)
flags.mark_flags_as_required(["config"])


def load_config(spec: str):
    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("plan_config", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def main(argv) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    config = load_config(_CONFIG.value)
    n = config.mesh.sampler[0] * config.mesh.sampler[1] + config.mesh.trainer[0] * config.mesh.trainer[1]
    import jax

    jax.config.update("jax_num_cpu_devices", n)
    jax.config.update("jax_platforms", "cpu")

    from jaxrl_async.model import from_hf_config, presets
    from jaxrl_async.perf.hardware import get_hardware
    from jaxrl_async.run_config import memory_sections
    from jaxrl_async.runtime.plan_check import (
        MIN_HEADROOM,
        fallback_line,
        headroom,
        mem_fraction,
        paged_kv_plan,
        plan_check,
        sharding_fallbacks,
        target_platform,
        weight_sync_plan,
    )

    m = config.model
    numerics = dict(dtype=m.dtype, param_dtype=m.param_dtype, attention=_ATTENTION.value or m.attention)
    if _HF_CONFIG.value:
        with open(hf_config_file(_HF_CONFIG.value, "--hf-config")) as f:
            model_cfg = from_hf_config(json.load(f), **numerics)
    else:
        model_cfg = presets.get(_PRESET.value or m.preset, **numerics)
    if _TOKEN_BUDGET.value:
        config.trainer.token_budget = _TOKEN_BUDGET.value
    if _LORA_RANK.value:  # docs/lora.md: the trainer then holds a frozen base, a version moves the adapters
        if _LORA_RANK.value < 0:
            raise app.UsageError(f"--lora-rank={_LORA_RANK.value}: must be >= 0")
        lora = config.trainer.lora  # its targets: the config's (every projection by default)
        lora.enabled, lora.rank, lora.alpha = True, _LORA_RANK.value, 2.0 * _LORA_RANK.value
    sections = memory_sections(config.to_dict())  # no data or reward section: a plan check reads no data
    train_cfg, sampler_cfg = sections["trainer"], sections["sampler"]
    hw = get_hardware(_HARDWARE.value)
    platform = target_platform(hw.name)
    if _MEM_FRACTION.value is not None:
        if not 0 < _MEM_FRACTION.value <= 1:
            raise app.UsageError(f"--mem-fraction={_MEM_FRACTION.value}: must be in (0, 1]")
        fraction, source = _MEM_FRACTION.value, "--mem-fraction"
    else:
        fraction, source = mem_fraction(platform, dict(os.environ))
    margin = MIN_HEADROOM if _MARGIN.value is None else _MARGIN.value
    if not 0 <= margin < 1:
        raise app.UsageError(f"--margin={margin}: must be in [0, 1)")
    report = plan_check(model_cfg, train_cfg, sampler_cfg, config.mesh, platform, config.eval_slots,
                        config.get("eval_weights", "own"))  # fmt: skip
    report["hardware"] = {"name": hw.name, "mem_bytes": hw.mem_bytes}
    peaks = {"trainer": report["trainer"]["peak_estimate"], "sampler": report["sampler"]["peak"]}
    report["fits"] = {role: peak <= hw.mem_bytes * fraction for role, peak in peaks.items()}
    report["headroom"], refusals = headroom(peaks, hw.mem_bytes, fraction, margin)
    report["headroom"].update(mem_fraction=fraction, mem_fraction_from=source, margin=margin)
    sa = report["sampler"]
    not_kv = sa["peak"] - sa["decode_state"]  # weights, the eval cache, decode temporaries
    group = int(config.get("samples_per_prompt", 1))
    report["weight_sync"] = weight_sync_plan(model_cfg, train_cfg.lora, config.mesh, hw.name)
    report["paged_kv"] = paged_kv_plan(
        model_cfg, sampler_cfg, tuple(config.mesh.sampler), hw.mem_bytes * fraction - not_kv,
        _MEDIAN_LEN.value, _P99_LEN.value, group, _PROMPT_LEN.value,
    )  # fmt: skip
    report["sharding_fallbacks"] = sharding_fallbacks(model_cfg, sampler_cfg, config.mesh)
    from jaxrl_async.perf import balance

    # The paged cache's decode batch per device: its slots, or what its pool (token_budget) holds of the
    # long-tailed mix, or what the free memory would hold, whichever is least.
    pk, data = report["paged_kv"], config.mesh.sampler[0]
    in_budget = sampler_cfg.token_budget / pk["long_tail"]["kv_tokens_per_sequence"]
    batch = min(pk["decode_batch_long_tail"], in_budget) / data
    bal = balance.predict(config, model_cfg, hw, sampler_cfg, train_cfg, _MEDIAN_LEN.value, _P99_LEN.value,
                          _PROMPT_LEN.value, sa["eval_slots"], batch)  # fmt: skip
    report["balance"] = {**dataclasses.asdict(bal), "bound": bal.bound,
                         "eval_train_steps": bal.eval_train_steps}  # fmt: skip
    print(json.dumps(report, indent=2))
    print(summary(report, config, train_cfg, sampler_cfg))
    pk = report["paged_kv"]
    print(
        f"  paged KV ({pk['page_size']}-position pages of {pk['page_bytes'] / 2**20:.2f} MiB per device, in "
        f"the {pk['free_bytes'] / 2**30:.2f} GiB left beside weights, eval cache and decode temporaries): "
        f"{pk['pages_per_device']} pages per device; concurrent sequences: {pk['sequences_at_max_len']} at "
        f"max_prompt_len + max_new_tokens = {sampler_cfg.max_seq_len}, {pk['sequences_long_tail']} on a "
        f"long tail (prompt {_PROMPT_LEN.value}, median {_MEDIAN_LEN.value:.0f}, p99 {_P99_LEN.value:.0f}, "
        f"group "
        f"{group}) vs {pk['sequences_slotted']} for the slotted cache; num_slots={sampler_cfg.num_slots} "
        f"caps the decode batch at {pk['decode_batch_long_tail']}"
    )
    for role in ("trainer", "sampler"):
        print(fallback_line(role, report["sharding_fallbacks"][role]))
    ws = report["weight_sync"]
    what = "the LoRA adapters, " if ws["lora"] else ""
    print(f"  weight sync: {what}{ws['bytes'] / 2**30:.3f} GiB per version to {ws['replicas']} replica(s), "
          f"predicted {ws['seconds']:.3f} s over {ws['link']} ({ws['link_source']}); other links: "
          + ", ".join(f"{k} {v:.3g} s" for k, v in ws["by_link"].items()))  # fmt: skip
    hr = report["headroom"]
    for role in ("trainer", "sampler"):
        r = hr[role]
        print(
            f"  {role} headroom: {r['headroom_bytes'] / 2**30:.2f} GiB ({r['headroom_fraction']:.1%}) of "
            f"{r['usable_bytes'] / 2**30:.2f} GiB usable (memory fraction {fraction:.2f} from {source}); "
            f"margin {margin:.0%} -> {'ok' if r['ok'] else 'REFUSED'}"
        )
    print(balance.report_lines(bal, _MAX_EVAL_STEPS.value))
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(report, f, indent=2)
    if refusals:
        print("plan check refuses this layout:\n  " + "\n  ".join(refusals))
        return 1
    return 0


def summary(report: dict, config, train_cfg, sampler_cfg) -> str:
    """The human-readable verdict printed after the JSON."""
    gib = 2**30
    g = lambda b: f"{b / gib:.2f} GiB"
    tr, sa, hw, ok = report["trainer"], report["sampler"], report["hardware"], report["fits"]
    verdict = lambda fits: "fits" if fits else "DOES NOT FIT"
    att = tr["attention"]
    st = tr["state"]
    lora = train_cfg.lora
    trained = f"LoRA rank {lora.rank} adapters (float32)" if lora.enabled else "master weights"
    an = sa["analytic"]
    lines = [
        f"\nper device, {hw['name']} has {hw['mem_bytes'] / gib:.1f} GiB, JAX may use "
        f"{report['headroom']['mem_fraction']:.2f} of it",
        f"  trainer {tuple(config.mesh.trainer)}: {train_cfg.rows_per_micro} rows x {train_cfg.token_budget} "
        f"tokens per micro-batch; params {tr['dtypes']['params']}, optimizer state "
        f"{tr['dtypes']['optimizer_state']}",
        f"    attention {att['target']} (compiled as {att['compiled_as']})"
        + (
            f"; cuDNN backward workspace {g(att['workspace_bytes'])} ({att['max_segments']} segments per row)"
            if att["workspace_bytes"]
            else ""
        ),
        f"    micro-batch: args {g(tr['argument_size'])} + optimizer state {g(tr['optimizer_state_bytes'])}, "
        f"temps {g(tr['temp_size'])}{' + workspace' if att['workspace_bytes'] else ''}; update: temps "
        f"{g(tr['apply']['temp_size'])}",
        f"    peak ~{g(tr['peak_estimate'])} -> {verdict(ok['trainer'])}",
        f"    declared: {trained} {g(st['params'])} + gradients {g(st['gradients'])} + AdamW "
        f"{g(st['optimizer_state'])}"
        + (f" + frozen base {g(st['frozen'])}" if st["frozen"] else "")
        + (f" + KL reference {g(st['reference'])}" if st["reference"] else "")
        + f" = {g(st['total'])}",
        f"  sampler {tuple(config.mesh.sampler)}: weights {sa['dtypes']} {g(sa['weights'])} x "
        f"{sa['weight_copies']} (config.eval_weights), "
        f"KV cache + state {g(sa['decode_state'])} ({sampler_cfg.num_slots} slots x {sampler_cfg.slot_len}), "
        f"eval engine {g(sa['eval_decode_state'])} ({sa['eval_slots']} slots)",
        f"    analytic: {sa['weight_copies']} x weights {g(an['weights'])} + KV {g(an['kv_cache'])} + "
        f"eval KV {g(an['eval_kv_cache'])}"
        + (f" + received LoRA base {g(an['received_base'])}" if an["received_base"] else "")
        + f" = {g(an['total'])}; compiled held {g(sa['held'])}",
        f"    temps {g(sa['temp_size_accelerator'])} (XLA:CPU {g(sa['generate']['temp_size'])}), weight "
        f"update +{g(sa['update_transient'])}; peak ~{g(sa['peak'])} -> {verdict(ok['sampler'])}",
    ]
    if sa["lora_apply"]:  # docs/lora.md: the received base stays; a version brings only the adapters
        lines.append(
            f"    LoRA (config.sampler.lora_apply={sa['lora_apply']!r}): the base received at start "
            f"{g(sa['received_base'])} kept beside the decode layout"
            + (", which carries the adapters" if sa["lora_apply"] == "unmerged" else "")
            + f"; a version brings the adapters, {g(sa['received_per_version'])}"
            + (", and writes a merged copy" if sa["lora_apply"] == "merge" else "")
        )
    lines += [
        f"    executable store key (a sampler process other than 0 hashes each program's StableHLO at "
        f"start): generate's is {sa['generate']['stablehlo_bytes'] / 2**20:.2f} MiB, printed and hashed in "
        f"{sa['generate']['stablehlo_key_s']:.3f} s",
    ]
    return "\n".join(lines)


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":  # `python -m jaxrl_async.cli.plan_check`, as the tests start it
    run()
