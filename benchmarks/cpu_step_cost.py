"""What one DFlash verify step costs on CPU against one plain generate step (SmolLM2-135M-Instruct, float32).

The drafter has random weights: acceptance does not matter here, only the cost of a step (propose + verify of
B rows + bookkeeping) next to the cost of one plain decoding step. Both run in this process, same prompts.
usage: python benchmarks/cpu_step_cost.py [--block-size 16] [--layers 1] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import transformers

from hf_dflash import DFlashCandidateGenerator, DFlashConfig, DFlashDraftModel
from hf_dflash.bundled_models import load_smollm2
from hf_dflash.generate_cli import encode

PROMPTS = ["Write a Python function that checks whether a number is prime.", "Why is the sky blue?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    target, tokenizer = load_smollm2()
    torch.manual_seed(0)
    config = DFlashConfig.for_target(target.config, num_hidden_layers=args.layers, block_size=args.block_size,
                                     mask_token_id=16)
    drafter = DFlashDraftModel(config).eval()

    propose_seconds: list[float] = []
    original = DFlashCandidateGenerator.get_candidates

    def timed_propose(self, input_ids, **kwargs):
        start = time.perf_counter()
        out = original(self, input_ids, **kwargs)
        propose_seconds.append(time.perf_counter() - start)
        return out

    DFlashCandidateGenerator.get_candidates = timed_propose
    plain_ms, step_ms, propose_ms = [], [], []
    for _ in range(args.repeats):
        for prompt in PROMPTS:
            inputs = encode(tokenizer, prompt, "cpu")
            settings = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)
            start = time.perf_counter()
            plain = target.generate(**inputs, **settings)
            plain_ms.append(1000 * (time.perf_counter() - start) / (plain.shape[1] - inputs["input_ids"].shape[1]))
            propose_seconds.clear()
            start = time.perf_counter()
            out = target.generate(**inputs, **settings, assistant_model=drafter, return_dict_in_generate=True)
            steps = len(out.acceptance_lengths[0])
            step_ms.append(1000 * (time.perf_counter() - start) / steps)
            propose_ms.append(1000 * statistics.mean(propose_seconds))
            assert torch.equal(plain, out.sequences)
    DFlashCandidateGenerator.get_candidates = original
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, CPU",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "target": "SmolLM2-135M-Instruct float32", "drafter_layers": args.layers, "block_size": args.block_size,
        "new_tokens": args.tokens,
        "plain_ms_per_token": statistics.median(plain_ms),
        "dflash_ms_per_verify_step": statistics.median(step_ms),
        "dflash_propose_ms": statistics.median(propose_ms),
    }
    result["step_over_plain_token"] = result["dflash_ms_per_verify_step"] / result["plain_ms_per_token"]
    print(json.dumps(result, indent=1))
    out = Path(__file__).parent / "results" / f"cpu_step_cost_b{args.block_size}_l{args.layers}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
