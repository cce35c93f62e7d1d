"""Export a run's checkpoint as a Hugging Face directory (config.json + safetensors + tokenizer files).

  jaxrl-export-hf WORKDIR [--step V] --out DIR        (or jaxrl-export-hf ...)

WORKDIR: a run's workdir, its checkpoints/ directory or one step in it (default: the newest version).
The result loads with `transformers.AutoModelForCausalLM.from_pretrained(DIR)` and serves with vLLM or
SGLang. Runs with the built-in "char" tokenizer get a `tokenizer.json` whose ids equal the run's
(`CharTokenizer.save_hf`), so a peer framework encodes prompts to the same ids.
"""

from __future__ import annotations

from absl import app, flags

from jaxrl_async import storage
from jaxrl_async.cli import run_command

_STEP = flags.DEFINE_integer("step", None, "the policy version (default: the newest)")
_OUT = flags.DEFINE_string("out", None, "the Hugging Face directory to write")
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


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":  # `python -m jaxrl_async.cli.export_hf`, as the tests start it
    run()
