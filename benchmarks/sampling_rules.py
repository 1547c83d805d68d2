"""Which exact acceptance rule under do_sample gives the higher tau: point mass (argmax drafts) or rejection
sampling (sampled drafts)? Same prompts, same drafter, one process.

usage: python benchmarks/sampling_rules.py --drafter DIR [--prompts 8] [--max-new-tokens 64] [--temperature 0.7]
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch
import transformers

from hf_dflash import DFlashDraftModel
from hf_dflash.generate_cli import load_target
from hf_dflash.training.data import load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--prompt-set", default="humaneval")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    target, tokenizer = load_target(args.target, dtype, device)
    drafter = DFlashDraftModel.from_pretrained(args.drafter, dtype=dtype).to(device).eval()
    tokenizer.padding_side = "left"
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in load_prompts(args.prompt_set)[: args.prompts]
    ]
    batch = tokenizer(prompts, return_tensors="pt", padding=True).to(device)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name() if device == "cuda" else f"{platform.machine()} CPU",
              "torch": torch.__version__, "transformers": transformers.__version__, "drafter": args.drafter,
              "prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
              "tau": {}}
    for rule in ("point_mass", "rejection"):
        steps = []
        for seed in range(args.seeds):
            torch.manual_seed(seed)
            out = target.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=True,
                                  temperature=args.temperature, top_p=None, top_k=None, assistant_model=drafter,
                                  dflash_sampling=rule, return_dict_in_generate=True,
                                  pad_token_id=tokenizer.pad_token_id)
            steps += [n for lengths in out.acceptance_lengths for n in lengths]
        result["tau"][rule] = sum(steps) / len(steps)
        print(rule, result["tau"][rule])
    path = Path(__file__).parent / "results" / f"sampling_rules_{args.target}_{device}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
