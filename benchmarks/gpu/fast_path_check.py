"""GPU check of the fast path (run on the device machine; CI covers the same step without a graph on the CPU).

On CUDA, in float32, with tiny random Llama and Qwen3 targets: the graph-replayed DFlash output equals plain greedy
generate and the eager DFlash loop, for batch 1 and a left-padded batch of 3, over repeated calls that reuse the
captured graph; under Qwen3's sampling defaults (and a repetition penalty) the graph-replayed step runs, and
torch.manual_seed reproduces its output. Prints one line per case and exits non-zero on a mismatch.

    python benchmarks/gpu/fast_path_check.py
"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, ".")
from tests.conftest import random_prompt, tiny_drafter, tiny_target  # noqa: E402


def sampled_runs_reproduce(target: torch.nn.Module, drafter: torch.nn.Module) -> bool:
    """Sampling inside the graph: the step is replayed (not run eagerly) and a seed reproduces a run."""
    ids = random_prompt(12, seed=7, batch=3).cuda()
    sampled = dict(max_new_tokens=48, do_sample=True, temperature=0.6, top_k=20, top_p=0.95, repetition_penalty=1.2)
    runs = []
    for seed in (5, 5):
        torch.manual_seed(seed)
        runs.append(target.generate(ids, assistant_model=drafter, pad_token_id=0, **sampled))
    graphed = bool(drafter._dflash_static_step[1].graphs)
    same = torch.equal(runs[0], runs[1])
    print(f"{target.config.model_type} sampled batch 3: graph {graphed}, same seed same tokens {same}")
    return graphed and same


def main() -> int:
    failures = 0
    for family in ("llama", "qwen3"):
        target = tiny_target(family).cuda()
        drafter = tiny_drafter(target, block_size=8).cuda()
        for batch, pads in ((1, [0]), (3, [0, 3, 6]), (3, [2, 0, 5])):
            ids = random_prompt(12, seed=batch, batch=batch).cuda()
            mask = torch.ones_like(ids)
            for row, pad in enumerate(pads):
                mask[row, :pad] = 0
            common = dict(attention_mask=mask, max_new_tokens=48, do_sample=False, pad_token_id=0)
            plain = target.generate(ids, **common)
            eager = target.generate(ids, assistant_model=drafter, dflash_fast_path=False, **common)
            fast = target.generate(ids, assistant_model=drafter, **common)
            graphed = bool(drafter._dflash_static_step[1].graphs)
            ok = torch.equal(plain, fast) and torch.equal(plain, eager) and graphed
            failures += not ok
            print(f"{family} batch {batch} pads {pads}: graph {graphed}, fast == plain {torch.equal(plain, fast)}, "
                  f"eager == plain {torch.equal(plain, eager)}")
        failures += not sampled_runs_reproduce(target, drafter)
    print("OK" if not failures else f"{failures} FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
