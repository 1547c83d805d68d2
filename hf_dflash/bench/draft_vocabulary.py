"""What a reduced draft vocabulary saves: the drafter's lm_head alone, and whole greedy calls with and without it.

A draft vocabulary (`DFlashDraftModel.set_draft_vocabulary`) makes the drafter score only the K target tokens its
training answers use most; the output stays plain greedy's, tau can only drop (a token outside the set is never
drafted), and the drafter's lm_head costs less.
1. The head alone (always; no model loaded): an lm_head of `--vocab` x `--hidden` with random weights over `--rows`
   draft rows (by default SmolLM2's head and a block of 16's 15 rows), the full `nn.Linear` against
   `DraftVocabularyHead` (the kept rows' matmul plus the full-vocabulary logits with -inf outside) at each of
   `--sizes`, median ms, and the one-time copy of the kept rows that each eager call (or a new fast-path step) makes.
2. Whole calls (with `--regenerated`: `hf-dflash train`'s regenerated data for the drafter's target, whose answers
   pick the K tokens): for each size, greedy calls with the vocabulary and with the full one, alternated round by
   round on the same prompts, batch 1: ms per verify step, tau, ms per committed token, and whether the outputs are
   identical.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from . import harness


@torch.no_grad()
def head_costs(args: argparse.Namespace, device: str) -> dict[str, Any]:
    from ..modeling.dflash_draft_vocabulary import DraftVocabularyHead

    torch.manual_seed(0)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False).to(device)
    hidden = torch.randn(1, args.rows, args.hidden, device=device)
    result: dict[str, Any] = {"vocab": args.vocab, "hidden": args.hidden, "rows": args.rows,
                              "full_head_ms": harness.time_call(lambda: head(hidden), repeats=50).median_ms}
    for size in args.sizes:
        token_ids = torch.randperm(args.vocab)[:size].sort().values
        started = time.perf_counter()
        draft_head = DraftVocabularyHead(head, token_ids, args.vocab, torch.device(device))
        harness.synchronize(device)
        result[f"copy_rows_{size}_ms"] = round(1000 * (time.perf_counter() - started), 4)
        result[f"draft_head_{size}_ms"] = harness.time_call(lambda: draft_head(hidden), repeats=50).median_ms
    return result


def decode(target: Any, drafter: Any, prompts: list[dict], max_new_tokens: int) -> dict[str, Any]:
    """Greedy decoding of each prompt with the drafter: ms per verify step, tau, ms per token, the sequences."""
    seconds, steps, tokens, sequences = 0.0, 0, 0, []
    for ids in prompts:
        out, took = harness.timed(lambda: target.generate(
            **ids, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=drafter,
            return_dict_in_generate=True,
        ))
        seconds += took
        steps += len(out.acceptance_lengths[0])
        tokens += sum(out.acceptance_lengths[0])
        sequences.append(out.sequences)
    return {"ms_per_step": 1e3 * seconds / steps, "tau": tokens / steps, "ms_per_token": 1e3 * seconds / tokens,
            "sequences": sequences}


@torch.no_grad()
def whole_calls(args: argparse.Namespace, device: str) -> dict[str, Any]:
    from ..generate_cli import DEFAULT_DRAFTER, encode, load_target
    from ..modeling import DFlashDraftModel
    from ..training.data import RegeneratedData, load_prompts

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    texts = load_prompts(args.prompts)[: args.limit]
    target, tokenizer = load_target(args.target, dtype, device)
    drafter = DFlashDraftModel.from_pretrained(args.drafter or DEFAULT_DRAFTER, dtype=dtype).to(device).eval()
    data = RegeneratedData.concat([RegeneratedData.load(path) for path in args.regenerated])
    answers = data.input_ids[data.loss_mask.bool()].long()
    prompts = [encode(tokenizer, text, device) for text in texts]
    result: dict[str, Any] = {"answer_tokens": len(answers), "sizes": {}}
    for size in args.sizes:
        vocabulary = data.most_frequent_response_tokens(size, drafter.config.vocab_size)

        def with_vocabulary(ids: torch.Tensor | None) -> Any:
            def calls() -> dict[str, Any]:
                drafter.set_draft_vocabulary(ids)
                return decode(target, drafter, prompts, args.max_new_tokens)

            return calls

        rounds = harness.alternate({"full": with_vocabulary(None), "restricted": with_vocabulary(vocabulary)},
                                   args.rounds)
        entry = {"coverage": float(torch.isin(answers, vocabulary).float().mean()), "rounds": []}
        for full, restricted in zip(rounds["full"], rounds["restricted"]):
            same = all(torch.equal(a, b) for a, b in zip(full.pop("sequences"), restricted.pop("sequences")))
            entry["rounds"].append({"full": full, "restricted": restricted, "outputs_identical": same})
            print(f"top {size} (coverage {entry['coverage']:.4f}): full {full['ms_per_step']:.1f} ms/step tau "
                  f"{full['tau']:.3f} | restricted {restricted['ms_per_step']:.1f} ms/step tau "
                  f"{restricted['tau']:.3f} | identical {same}", flush=True)
        result["sizes"][str(size)] = entry
    drafter.set_draft_vocabulary(None)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=int, nargs="+", default=[8192, 16384], help="draft vocabulary sizes K")
    parser.add_argument("--vocab", type=int, default=49152, help="the head's vocabulary (default: SmolLM2's)")
    parser.add_argument("--hidden", type=int, default=576, help="the head's width (default: SmolLM2's)")
    parser.add_argument("--rows", type=int, default=15, help="draft rows per call (default: a block of 16's)")
    parser.add_argument("--regenerated", nargs="+", default=None,
                        help="regenerated data (.safetensors) whose answers pick the tokens; whole calls run only "
                        "with it")
    parser.add_argument("--target", default="smollm2", help="smollm2 (default), stories260k, or a path/id")
    parser.add_argument("--drafter", default=None, help="drafter directory (default: our SmolLM2 drafter)")
    parser.add_argument("--prompts", default="sharegpt:8", help="humaneval, sharegpt:N or a .jsonl file")
    parser.add_argument("--limit", type=int, default=6, help="number of prompts")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of full and reduced vocabulary, alternated")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")


def check(args: argparse.Namespace) -> None:
    from ..cli_checks import BadArgument, at_least, check_device, check_drafter, check_model, check_prompts

    for option in ("vocab", "hidden", "rows", "limit", "max_new_tokens", "rounds"):
        at_least("--" + option.replace("_", "-"), getattr(args, option), 1)
    for size in args.sizes:
        if not 1 <= size <= args.vocab:
            raise BadArgument(f"--sizes {size}: a draft vocabulary holds 1 .. --vocab ({args.vocab}) tokens")
    check_device("--device", args.device)
    if args.regenerated is not None:
        for path in args.regenerated:
            if not Path(path).is_file():
                raise BadArgument(f"--regenerated {path}: no such file; pass `hf-dflash train`'s regenerated data")
        check_prompts("--prompts", args.prompts)
        check_model("--target", args.target)
        check_drafter("--drafter", args.drafter)


def run(args: argparse.Namespace) -> int:
    device = args.device or harness.default_device()
    report = harness.header(args, device)
    report.update(head=head_costs(args, device))
    print(f"head: {report['head']}", flush=True)
    if args.regenerated is not None:
        report["calls"] = whole_calls(args, device)
    harness.write_report(args.out, report, plot)
    return 0


def plot(report: dict, path: Path) -> None:
    """The head's ms per size beside the full head's; with whole calls, tau and ms per token per size."""
    plt = harness.pyplot()
    calls = report.get("calls")
    fig, axes = plt.subplots(1, 3 if calls else 1, figsize=(14 if calls else 5, 4), squeeze=False)
    head = report["head"]
    sizes = sorted(int(key.split("_")[2]) for key in head if key.startswith("draft_head_"))
    axes[0][0].bar([str(s) for s in sizes] + ["full"], [head[f"draft_head_{s}_ms"] for s in sizes] +
                   [head["full_head_ms"]])
    axes[0][0].set(xlabel="draft vocabulary", ylabel="ms per head call (median)", title="the head alone")
    if calls:
        keys = sorted(calls["sizes"], key=int)
        for axis, field in zip(axes[0][1:], ("tau", "ms_per_token")):
            for kind, style in (("restricted", "o-"), ("full", "s--")):
                axis.plot([int(k) for k in keys], [statistics.mean(r[kind][field] for r in calls["sizes"][k]["rounds"])
                                                   for k in keys], style, label=f"{kind} vocabulary")
            axis.set(xlabel="draft vocabulary size", ylabel=field.replace("_", " "), title="whole calls")
            axis.legend(fontsize=8)
    fig.suptitle(f"{report['machine']} ({report['date'][:10]})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
