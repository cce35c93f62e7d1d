"""Export a run's checkpoint as a Hugging Face directory (config.json + safetensors + tokenizer files).

  jaxrl-export-hf WORKDIR [--step V] --out DIR        (or jaxrl-export-hf ...)

WORKDIR: a run's workdir, its checkpoints/ directory or one step in it (default: the newest version).
The result loads with `transformers.AutoModelForCausalLM.from_pretrained(DIR)` and serves with vLLM or
SGLang. Runs with the built-in "char" tokenizer get a `tokenizer.json` whose ids equal the run's
(`CharTokenizer.save_hf`), so a peer framework encodes prompts to the same ids.

A LoRA run's checkpoint (config.trainer.lora) exports merged (W + (alpha/r)·A·B) to --out; with
--peft_dir DIR it also writes the adapters as a PEFT adapter directory in DIR and the frozen base as a
Hugging Face model in DIR/base, so `peft.PeftModel.from_pretrained(base, DIR)` gives the same policy.
"""

from __future__ import annotations

from absl import app, flags

from jaxrl_async import storage
from jaxrl_async.cli import run_command

_STEP = flags.DEFINE_integer("step", None, "the policy version (default: the newest)")
_OUT = flags.DEFINE_string("out", None, "the Hugging Face directory to write")
_PEFT_DIR = flags.DEFINE_string("peft_dir", None, "LoRA runs: also a PEFT adapter directory (and base/)")
flags.mark_flags_as_required(["out"])


def main(argv) -> None:
    if len(argv) != 2:
        raise app.UsageError("give one WORKDIR: a run's workdir, its checkpoints/ or a step directory in it")
    workdir = argv[1]

    import jax

    from jaxrl_async.model import save_hf
    from jaxrl_async.runtime.checkpoint import load_policy
    from jaxrl_async.sharding import SAMPLER_RULES, make_mesh

    mesh = make_mesh((1, 1), ("data", "tensor"), jax.local_devices()[:1])
    try:
        model_cfg, params, tokenizer, version = load_policy(workdir, mesh, SAMPLER_RULES, _STEP.value)
    except FileNotFoundError as e:
        raise app.UsageError(str(e)) from None
    tok_dir = None
    if tokenizer != "char" and storage.isdir(tokenizer):  # a gs:// tokenizer: this host's copy of its files
        tok_dir = storage.local_dir(tokenizer)
    save_hf(model_cfg, params, _OUT.value, tokenizer_dir=tok_dir)
    print(f"policy version {version} -> {_OUT.value}")
    if tokenizer == "char":
        from jaxrl_async.tokenizer import CharTokenizer

        CharTokenizer().save_hf(_OUT.value)
        print("tokenizer: the character vocabulary as tokenizer.json (the run's ids)")
    elif tok_dir is None:
        print(f"no Hugging Face tokenizer to copy (the run used {tokenizer!r}): the export holds the model")
    if _PEFT_DIR.value:
        _export_peft(workdir, model_cfg, mesh, version, tok_dir, tokenizer)


def _export_peft(workdir, model_cfg, mesh, version: int, tok_dir, tokenizer) -> None:
    import os

    from jaxrl_async.model import save_hf
    from jaxrl_async.model.lora_hf import save_peft
    from jaxrl_async.runtime import lora_checkpoint
    from jaxrl_async.runtime.checkpoint import find_checkpoints
    from jaxrl_async.sharding import SAMPLER_RULES

    directory = find_checkpoints(workdir)
    if not lora_checkpoint.is_lora(directory):
        raise app.UsageError(f"--peft_dir: {directory} is not a LoRA run's (no {lora_checkpoint.LORA_FILE})")
    lora, base, adapters = lora_checkpoint.load_lora_policy(
        directory, model_cfg, mesh, SAMPLER_RULES, version
    )
    base_dir = os.path.join(_PEFT_DIR.value, "base")
    save_hf(model_cfg, base, base_dir, tokenizer_dir=tok_dir)
    if tokenizer == "char":
        from jaxrl_async.tokenizer import CharTokenizer

        CharTokenizer().save_hf(base_dir)
    save_peft(model_cfg, lora, adapters, _PEFT_DIR.value, base_model=os.path.abspath(base_dir))
    print(f"LoRA rank {lora.rank} adapters -> {_PEFT_DIR.value} (PEFT), its base -> {base_dir}")


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":  # `python -m jaxrl_async.cli.export_hf`, as the tests start it
    run()
