"""TRL's own GRPO loop (`trl.GRPOTrainer`, sync, transformers `generate`) on the benchmark's spec.

  python trl_grpo.py SPEC.json RESULT.json [--step0]

Runs in the TRL venv that benchmarks/bench_peers.py builds (torch CPU, transformers 5, trl). CPU only
(`use_cpu=True`, `use_vllm=False`: TRL's vLLM paths need a vLLM that takes in-place weight updates, which
vLLM's CPU build does not). Settings taken from the spec: the warm start, the prompts in our order
(`shuffle_dataset=False`), the reward, prompts x samples per step, new tokens, temperature, AdamW with our
schedule (passed as the optimizer and a LambdaLR), the clip range, no KL (beta 0), one update per batch,
token-level loss aggregation (`loss_type="dapo"`, as our token_mean). --step0: only the step-0 evaluation.
No patch is needed.
"""

from __future__ import annotations

import sys
import tempfile

# common.py lies beside this copy: a script's own directory is on its sys.path.
from common import Clock, batches, load_spec, lr_factor, read_jsonl, reward, write_result


def greedy_accuracy(model, tok, rows: list[dict], spec: dict) -> float:
    """Held-out greedy exact match, weighted by each row's "weight": prompts grouped by length (no
    padding, positions from 0, as our engine decodes them), up to max_new_tokens, the completion cut at
    eos."""
    import torch

    by_len: dict[int, list[dict]] = {}
    for r in rows:
        by_len.setdefault(len(r["prompt_ids"]), []).append(r)
    right = 0.0
    with torch.no_grad():
        for n, group in by_len.items():
            ids = torch.tensor([r["prompt_ids"] for r in group])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=spec["max_new_tokens"], eos_token_id=spec["eos_id"],
                                 pad_token_id=spec["pad_id"])  # fmt: skip
            for r, seq in zip(group, out[:, n:].tolist(), strict=True):
                seq = seq[: seq.index(spec["eos_id"])] if spec["eos_id"] in seq else seq
                text = tok.decode(seq, skip_special_tokens=True)
                right += r["weight"] * (reward(spec["reward"], text, r["answer"]) >= 1.0)
    return right / sum(r["weight"] for r in rows)


def main(argv: list[str]) -> None:
    spec_path, result_path = argv[1], argv[2]
    spec = load_spec(spec_path)
    import torch
    import transformers
    import trl

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    tok = transformers.AutoTokenizer.from_pretrained(spec["model_dir"])
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    heldout = read_jsonl(spec["heldout_jsonl"])
    for r in heldout[:50]:
        got = tok(r["prompt"], add_special_tokens=False)["input_ids"]
        if got != r["prompt_ids"]:
            raise SystemExit(f"tokenizer mismatch on {r['prompt']!r}: {got} vs ours {r['prompt_ids']}")
    clock = Clock()
    model.eval()
    clock.evaluate(0, lambda: greedy_accuracy(model, tok, heldout, spec))
    versions = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}
    if "--step0" in argv:
        write_result(result_path, "trl", trl.__version__, clock, [], versions=versions)
        return
    import datasets

    steps, size = spec["steps"], spec["prompts_per_step"]
    rows = [r for b in batches(read_jsonl(spec["train_jsonl"]), size, steps) for r in b]
    data = datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])

    def reward_fn(prompts, completions, answer, completion_ids=None, **_):
        for p, c, ids in zip(prompts, completions, completion_ids or [None] * len(prompts), strict=True):
            n = len(ids) if ids is not None else len(tok(c, add_special_tokens=False)["input_ids"]) + 1
            clock.trained_tokens += len(tok(p, add_special_tokens=False)["input_ids"]) + n
        return [reward(spec["reward"], c, a) for c, a in zip(completions, answer, strict=True)]

    class Evaluate(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step % spec["eval_every"] == 0 or state.global_step == steps:
                model.eval()
                clock.evaluate(state.global_step, lambda: greedy_accuracy(model, tok, heldout, spec))
                model.train()

    group = spec["samples_per_prompt"]
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], betas=(spec["b1"], spec["b2"]),
                            eps=spec["adam_eps"], weight_decay=spec["weight_decay"])  # fmt: skip
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(spec, s))
    args = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_grpo_"), use_cpu=True, use_vllm=False, report_to="none",
        save_strategy="no", logging_steps=max(spec["eval_every"], 1), seed=spec["seed"],
        per_device_train_batch_size=size * group, gradient_accumulation_steps=1, num_generations=group,
        max_completion_length=spec["max_new_tokens"], temperature=spec["temperature"], top_p=1.0,
        learning_rate=spec["lr"], max_steps=steps, beta=0.0, num_iterations=1, epsilon=spec["eps_low"],
        epsilon_high=spec["eps_high"], loss_type="dapo", scale_rewards="group",
        max_grad_norm=spec["clip_norm"] or 0.0, shuffle_dataset=False, bf16=False, fp16=False,
        dataloader_num_workers=0,
    )  # fmt: skip
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=reward_fn, args=args, train_dataset=data, processing_class=tok,
        optimizers=(opt, sched), callbacks=[Evaluate()],
    )  # fmt: skip
    clock.restart()
    model.train()
    trainer.train()
    write_result(result_path, "trl", trl.__version__, clock, [], versions=versions)


if __name__ == "__main__":
    main(sys.argv)
