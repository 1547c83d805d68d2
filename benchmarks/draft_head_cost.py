"""What the propose's lm_head costs on CPU over the full vocabulary and over a reduced draft vocabulary (float32).

SmolLM2-135M's head shape (49,152 x 576) with random weights and B - 1 = 15 draft rows, one intra-op thread: the full
`nn.Linear` against `DraftVocabularyHead` (the kept rows' matmul plus the full-vocabulary logits with -inf outside),
and the one-time copy of the kept rows that each eager generate call (or a new fast-path step) makes. Median of 50.
usage: python benchmarks/draft_head_cost.py [--out benchmarks/results/draft_head_cost_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import transformers

from hf_dflash.modeling.dflash_draft_vocabulary import DraftVocabularyHead

VOCAB, HIDDEN, ROWS = 49_152, 576, 15


def median_ms(fn, repeats: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2] * 1e3


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    hidden = torch.randn(1, ROWS, HIDDEN)
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.processor() or
        platform.machine(), "torch": torch.__version__, "transformers": transformers.__version__, "threads": 1,
        "vocab": VOCAB, "hidden": HIDDEN, "rows": ROWS, "full_head_ms": median_ms(lambda: head(hidden)),
    }
    for size in (16_384, 8_192):
        token_ids = torch.randperm(VOCAB)[:size].sort().values
        start = time.perf_counter()
        draft_head = DraftVocabularyHead(head, token_ids, VOCAB, torch.device("cpu"))
        result[f"copy_rows_{size}_ms"] = (time.perf_counter() - start) * 1e3
        result[f"draft_head_{size}_ms"] = median_ms(lambda: draft_head(hidden))
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
