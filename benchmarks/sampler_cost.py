"""What drawing a sampled step's tokens costs with each of `sample`'s two exact rules (the exponential race and the
inverse CDF), alone and inside whole sampled generate calls, side by side in one process.

1. The rules alone: one call on the rows a verify step samples (batch x block rows of the vocabulary), median ms.
2. Whole calls: the target's sampled generate with our drafter, ms per verify step with each rule forced (in the
   order race, inverse CDF, race, inverse CDF, so that drift of a shared machine shows as a gap between the rounds),
   beside plain sampled generate's ms per token and our greedy step on the same prompts. On a GPU, calls use the race
   (see `sample`); the inverse CDF is forced there only to time it.

usage: python benchmarks/sampler_cost.py [--target smollm2] [--prompts sharegpt:8] [--max-new-tokens 96]
Writes benchmarks/results/sampler_cost_<target>_<device>.json, and a plot beside it when matplotlib is installed.
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
from hf_dflash.modeling import dflash_acceptance
from hf_dflash.modeling.dflash_fast_path import release_fast_path
from hf_dflash.training.data import load_prompts

RULES = {"exponential race": dflash_acceptance.exponential_race_sample,
         "inverse CDF": dflash_acceptance.inverse_cdf_sample}
DEVICE_RULE = dflash_acceptance.sample  # what a call uses: the inverse CDF on a CPU, the race elsewhere
LLAMA3_SAMPLING = dict(do_sample=True, temperature=0.6, top_p=0.9)  # Llama-3.1-Instruct's generation_config


def rule_alone_ms(rule, rows: int, vocab: int, device: str, repeats: int = 20) -> float:
    """Median ms of one call on `rows` rows of a top-p-like distribution (most of each row zero)."""
    probs = torch.softmax(torch.randn(rows, vocab, device=device) * 6, dim=-1)
    probs[probs < probs.topk(50, dim=-1).values[:, -1:]] = 0
    times = [timed(lambda: rule(probs))[1] * 1e3 for _ in range(repeats + 2)]
    return statistics.median(times[2:])


def decode_ms(target, drafter, prompts, max_new_tokens: int, device: str, **settings) -> tuple[float, float]:
    """(ms per verify step, or per token without a drafter; tau) over the prompts, one by one."""
    seconds, steps, tokens = 0.0, 0, 0
    for i, ids in enumerate(prompts):
        torch.manual_seed(i)
        out, took = timed(lambda: target.generate(
            **ids, max_new_tokens=max_new_tokens, return_dict_in_generate=True,
            **({"assistant_model": drafter} if drafter is not None else {}), **settings,
        ))
        seconds += took
        new = out.sequences.shape[1] - ids["input_ids"].shape[1]
        tokens += new
        steps += len(out.acceptance_lengths[0]) if drafter is not None else new
    return seconds / steps * 1e3, tokens / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--drafter", default=str(DEFAULT_DRAFTER))
    parser.add_argument("--prompts", default="sharegpt:8", help="humaneval, sharegpt:N or a .jsonl file")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = args.device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    target, tokenizer = load_target(args.target, dtype, device)
    drafter = DFlashDraftModel.from_pretrained(args.drafter, dtype=dtype).to(device).eval()
    prompts = [encode(tokenizer, text, device) for text in load_prompts(args.prompts)[: args.limit]]
    vocab, block = drafter.config.vocab_size, drafter.config.block_size
    pad = dict(pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)

    alone = {name: {f"{batch} x {block} rows": rule_alone_ms(rule, batch * block, vocab, device)
                    for batch in (1, 4, 16)} for name, rule in RULES.items()}
    print(json.dumps(alone, indent=1))

    decode_ms(target, drafter, prompts[:1], 8, device, **LLAMA3_SAMPLING, **pad)  # warm-up (and any compile)
    whole: dict[str, list[dict[str, float]]] = {name: [] for name in RULES}
    for round_ in range(2):
        for name, rule in RULES.items():
            release_fast_path(drafter)  # a held CUDA graph keeps the rule it was recorded with
            dflash_acceptance.sample = rule
            try:
                ms, tau = decode_ms(target, drafter, prompts, args.max_new_tokens, device, **LLAMA3_SAMPLING, **pad)
            finally:
                dflash_acceptance.sample = DEVICE_RULE
            whole[name].append({"ms_per_step": ms, "tau": tau})
            print(f"round {round_ + 1}, {name}: {ms:.1f} ms per step, tau {tau:.2f}", file=sys.stderr)
    release_fast_path(drafter)
    greedy_ms, greedy_tau = decode_ms(target, drafter, prompts, args.max_new_tokens, device, do_sample=False, **pad)
    plain_ms, _ = decode_ms(target, None, prompts, args.max_new_tokens, device, **LLAMA3_SAMPLING, **pad)

    result = {
        **run_environment(device), "threads": torch.get_num_threads(),
        "command": " ".join(["python", *sys.argv]), "target": args.target, "drafter": Path(args.drafter).name,
        "dtype": str(dtype).replace("torch.", ""), "prompts": args.prompts, "limit": len(prompts),
        "max_new_tokens": args.max_new_tokens, "sampling": LLAMA3_SAMPLING,
        "rule_alone_ms": alone, "sampled_step": whole,
        "greedy_step": {"ms_per_step": greedy_ms, "tau": greedy_tau}, "plain_sampled_ms_per_token": plain_ms,
    }
    path = Path(__file__).parent / "results" / f"sampler_cost_{args.target}_{device.split(':')[0]}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    plot(result, path.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'hf-dflash[bench]')", file=sys.stderr)
        return
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    shapes = list(next(iter(result["rule_alone_ms"].values())))
    for offset, (name, costs) in zip((-0.2, 0.2), result["rule_alone_ms"].items()):
        left.bar([i + offset for i in range(len(shapes))], [costs[s] for s in shapes], width=0.4, label=name)
    left.set_xticks(range(len(shapes)), shapes)
    left.set_yscale("log")
    left.set_ylabel("ms per call (median)")
    left.set_title(f"one draw per row, vocabulary of the drafter ({result['machine']}, {result['threads']} threads)", fontsize=9)
    left.legend()
    bars = {f"sampled,\n{name}": statistics.mean(r["ms_per_step"] for r in runs)
            for name, runs in result["sampled_step"].items()}
    bars["greedy"] = result["greedy_step"]["ms_per_step"]
    bars["plain sampled\n(per token)"] = result["plain_sampled_ms_per_token"]
    right.bar(range(len(bars)), list(bars.values()), color=["C0", "C1", "C2", "C7"])
    right.set_xticks(range(len(bars)), list(bars), fontsize=8)
    right.set_ylabel("ms per verify step")
    right.set_title(f"{result['target']} + {result['drafter']}, {result['dtype']}, batch 1, "
                    f"{result['max_new_tokens']} new tokens", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
