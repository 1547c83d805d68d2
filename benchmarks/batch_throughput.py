"""Batched throughput: DFlash against plain batched generate, side by side in one process, same prompts.

For each batch size, the same HumanEval prompts are decoded (left-padded, greedy) by plain `generate` and by
`generate(assistant_model=drafter)`; we report new tokens per second for both, tau, and check that the outputs are
identical. Results go to benchmarks/results/<name>.json and a plot beside it.

usage: python benchmarks/batch_throughput.py --drafter DIR [--target smollm2] [--batch-sizes 1 4 16]
       [--prompts 16] [--max-new-tokens 128] [--device cpu|cuda] [--name NAME]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hf_dflash import DFlashDraftModel
from hf_dflash.bench import run_environment
from hf_dflash.generate_cli import load_target, timed
from hf_dflash.training.data import load_prompts

RESULTS = Path(__file__).parent / "results"


def new_token_count(sequences: torch.Tensor, prompt_width: int, pad_id: int, eos_id: int | None) -> int:
    """Real new tokens: up to and including each row's eos, padding after it excluded."""
    total = 0
    for row in sequences[:, prompt_width:].tolist():
        if eos_id is not None and eos_id in row:
            row = row[: row.index(eos_id) + 1]
        total += len(row)
    return total


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["batch_size"] for r in result["runs"]]
    width = 0.38
    fig, ax = plt.subplots(figsize=(6, 3.6))
    xs = range(len(sizes))
    ax.bar([x - width / 2 for x in xs], [r["plain_tok_s"] for r in result["runs"]], width, label="plain generate")
    ax.bar([x + width / 2 for x in xs], [r["dflash_tok_s"] for r in result["runs"]], width, label="DFlash")
    for x, r in zip(xs, result["runs"]):
        ax.annotate(f"{r['speedup']:.2f}x\ntau {r['tau']:.2f}", (x + width / 2, r["dflash_tok_s"]), ha="center",
                    va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [str(s) for s in sizes])
    ax.set_xlabel("batch size")
    ax.set_ylabel("new tokens / s")
    ax.set_title(f"{result['target']} on {result['machine']}, greedy, {result['max_new_tokens']} new tokens", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--prompts", type=int, default=16, help="first N HumanEval prompts")
    parser.add_argument("--prompt-set", default="humaneval", help="humaneval, sharegpt:N or a jsonl path")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--name", default=None)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    target, tokenizer = load_target(args.target, dtype, args.device)
    drafter = DFlashDraftModel.from_pretrained(args.drafter, dtype=dtype).to(args.device).eval()
    tokenizer.padding_side = "left"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompts = load_prompts(args.prompt_set)[: args.prompts]
    if getattr(tokenizer, "chat_template", None):
        prompts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts
        ]
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad_id)
    warm = tokenizer(prompts[:2], return_tensors="pt", padding=True).to(args.device)
    target.generate(**warm, max_new_tokens=8, do_sample=False, pad_token_id=pad_id)
    target.generate(**warm, max_new_tokens=8, do_sample=False, pad_token_id=pad_id, assistant_model=drafter)

    runs = []
    for batch_size in args.batch_sizes:
        plain_s = dflash_s = 0.0
        tokens = 0
        steps: list[int] = []
        identical = True
        for start in range(0, len(prompts), batch_size):
            batch = tokenizer(prompts[start : start + batch_size], return_tensors="pt", padding=True).to(args.device)
            width = batch["input_ids"].shape[1]
            plain, seconds = timed(lambda: target.generate(**batch, **settings))
            plain_s += seconds
            out, seconds = timed(
                lambda: target.generate(**batch, **settings, assistant_model=drafter, return_dict_in_generate=True)
            )
            dflash_s += seconds
            identical &= torch.equal(plain, out.sequences)
            tokens += new_token_count(plain, width, pad_id, tokenizer.eos_token_id)
            steps += [n for lengths in out.acceptance_lengths for n in lengths]
        run = {
            "batch_size": batch_size,
            "prompts": len(prompts),
            "new_tokens": tokens,
            "plain_tok_s": tokens / plain_s,
            "dflash_tok_s": tokens / dflash_s,
            "speedup": plain_s / dflash_s,
            "tau": sum(steps) / len(steps),
            "identical": identical,
        }
        runs.append(run)
        print(json.dumps(run))
    result = {
        **run_environment(args.device),
        "target": args.target,
        "drafter": str(args.drafter),
        "dtype": str(dtype).replace("torch.", ""),
        "prompt_set": args.prompt_set,
        "max_new_tokens": args.max_new_tokens,
        "runs": runs,
    }
    RESULTS.mkdir(exist_ok=True)
    name = args.name or f"batch_throughput_{args.target}_{args.device.split(':')[0]}"
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, RESULTS / f"{name}.png")
    print(f"wrote {RESULTS / name}.json and .png")


if __name__ == "__main__":
    main()
