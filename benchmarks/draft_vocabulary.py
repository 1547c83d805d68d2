"""Whole greedy calls with a draft vocabulary against the full vocabulary: tau, ms per step, ms per token (a CPU).

A draft vocabulary (`DFlashDraftModel.set_draft_vocabulary`) makes the drafter score only the K target tokens its
training answers use most (`RegeneratedData.most_frequent_response_tokens`); the output stays plain greedy's, tau can
only drop (a token outside the set is never drafted) and the drafter's lm_head costs less
(`benchmarks/draft_head_cost.py` times the head alone). This measures what a whole call gains, in one process: for each
size, calls with the vocabulary and with the full one, alternated round by round, on the same prompts.

usage: python benchmarks/draft_vocabulary.py --regenerated DATA.safetensors [...] --prompts P.jsonl.gz --limit 6
  (DATA: `hf-dflash train`'s regenerated data for the drafter's target; its answers are the target's own outputs)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from hf_dflash import DFlashDraftModel
from hf_dflash.bench import run_environment
from hf_dflash.generate_cli import DEFAULT_DRAFTER, encode, load_target, timed
from hf_dflash.training.data import RegeneratedData, load_prompts


def decode(target, drafter, prompts, max_new_tokens: int) -> dict:
    """Greedy decoding of each prompt with the drafter: ms per verify step, tau, the sequences."""
    seconds, steps, tokens, sequences = 0.0, 0, 0, []
    for ids in prompts:
        out, took = timed(lambda: target.generate(
            **ids, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=drafter,
            return_dict_in_generate=True,
        ))
        seconds += took
        steps += len(out.acceptance_lengths[0])
        tokens += sum(out.acceptance_lengths[0])
        sequences.append(out.sequences)
    return {"ms_per_step": 1e3 * seconds / steps, "tau": tokens / steps, "ms_per_token": 1e3 * seconds / tokens,
            "sequences": sequences}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regenerated", nargs="+", required=True, help="regenerated data (.safetensors) to count")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--drafter", default=str(DEFAULT_DRAFTER))
    parser.add_argument("--prompts", default="sharegpt:8", help="humaneval, sharegpt:N or a .jsonl file")
    parser.add_argument("--limit", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/draft_vocabulary_smollm2_cpu.json")
    args = parser.parse_args()

    torch.set_grad_enabled(False)
    target, tokenizer = load_target("smollm2", torch.float32, "cpu")
    drafter = DFlashDraftModel.from_pretrained(args.drafter, dtype=torch.float32).eval()
    data = RegeneratedData.concat([RegeneratedData.load(path) for path in args.regenerated])
    answers = data.input_ids[data.loss_mask.bool()].long()
    prompts = [encode(tokenizer, prompt, "cpu") for prompt in load_prompts(args.prompts)[: args.limit]]
    result = {**run_environment("cpu"), "command": " ".join(sys.argv), "answer_tokens": len(answers), "sizes": {}}
    for size in args.sizes:
        vocabulary = data.most_frequent_response_tokens(size, drafter.config.vocab_size)
        entry = {"coverage": float(torch.isin(answers, vocabulary).float().mean()), "rounds": []}
        for _ in range(args.rounds):  # alternated, so that drift on the machine hits both alike
            drafter.set_draft_vocabulary(None)
            full = decode(target, drafter, prompts, args.max_new_tokens)
            drafter.set_draft_vocabulary(vocabulary)
            restricted = decode(target, drafter, prompts, args.max_new_tokens)
            same = all(torch.equal(a, b) for a, b in zip(full.pop("sequences"), restricted.pop("sequences")))
            entry["rounds"].append({"full": full, "restricted": restricted, "outputs_identical": same})
            print(f"top {size} (coverage {entry['coverage']:.4f}): full {full['ms_per_step']:.1f} ms/step tau "
                  f"{full['tau']:.3f} ({full['ms_per_token']:.1f} ms/token) | restricted "
                  f"{restricted['ms_per_step']:.1f} ms/step tau {restricted['tau']:.3f} "
                  f"({restricted['ms_per_token']:.1f} ms/token) | identical {same}", flush=True)
        result["sizes"][str(size)] = entry
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    plot(result, out.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    """Tau and ms per token against the vocabulary size, each beside the full vocabulary's in the same rounds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(result["sizes"], key=int)
    x = [int(s) for s in sizes]

    def mean(key: str, field: str) -> list[float]:
        return [statistics.mean(r[key][field] for r in result["sizes"][s]["rounds"]) for s in sizes]

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for axis, field, title in zip(axes, ("tau", "ms_per_token"), ("tau", "ms per committed token (CPU, float32)")):
        axis.plot(x, mean("restricted", field), "o-", label="draft vocabulary")
        axis.plot(x, mean("full", field), "s--", label="full vocabulary (same rounds)")
        axis.set(xlabel="draft vocabulary size", ylabel=field.replace("_", " "), title=title)
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
