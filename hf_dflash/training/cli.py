"""`hf-dflash train` and `hf-dflash eval`: the training recipe and the acceptance check from the command line.

    hf-dflash train --target stories260k --mask-token-id 0 --prompts prompts.jsonl --out my-drafter
    accelerate launch -m hf_dflash.cli train --target /models/Qwen3-8B --prompts sharegpt.jsonl --out q3-drafter
    hf-dflash eval --target stories260k --drafter my-drafter --prompts prompts.jsonl --limit 8

`register(subparsers)` adds both subcommands to the top-level parser; each sets `func` to its `run` function.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from accelerate import PartialState
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..modeling import DFlashDraftModel
from .data import RegeneratedData, load_prompts, regenerate, write_jsonl_prompts
from .drafter import new_drafter
from .evaluate import measure_tau
from .trainer import TrainingArguments, train

BUNDLED_TARGETS = ("smollm2", "stories260k")


def load_target(spec: str, device: torch.device | str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A target by path or Hub id, or a bundled offline model by name; bfloat16 on GPU, float32 on CPU."""
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if spec in BUNDLED_TARGETS:
        from .. import bundled_models

        loader = bundled_models.load_smollm2 if spec == "smollm2" else bundled_models.load_stories260k
        return loader(dtype=dtype, device=device)
    model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype).to(device).eval()
    return model, AutoTokenizer.from_pretrained(spec)


def _regenerated_data(args: argparse.Namespace, target, tokenizer, state: PartialState) -> RegeneratedData:
    """Reuse `--regenerated` if it exists; otherwise every process answers its share of the prompts."""
    path = Path(args.regenerated or Path(args.out) / "regenerated.safetensors")
    if path.is_file():
        return RegeneratedData.load(path)
    prompts = load_prompts(args.prompts)
    part = path.with_suffix(f".part{state.process_index}.safetensors")
    regenerate(
        target,
        tokenizer,
        prompts[state.process_index :: state.num_processes],
        max_new_tokens=args.max_new_tokens,
        batch_size=args.gen_batch_size,
        do_sample=args.temperature > 0,
        temperature=args.temperature or 1.0,
        seed=args.seed + state.process_index,
        progress=state.is_local_main_process,
        max_prompt_tokens=args.max_prompt_tokens,
    ).save(part)
    state.wait_for_everyone()
    if state.is_main_process:
        parts = [path.with_suffix(f".part{i}.safetensors") for i in range(state.num_processes)]
        data = RegeneratedData.concat([RegeneratedData.load(p) for p in parts])
        data.save(path)
        for p in parts:
            p.unlink()
        print(f"regenerated {len(data)} sequences, {data.num_response_tokens} answer tokens, "
              f"{data.tokens_per_second:.0f} tokens/s -> {path}")
    state.wait_for_everyone()
    return RegeneratedData.load(path)


def run(args: argparse.Namespace) -> int:
    """`hf-dflash train`: regenerate (or reuse) data, train a drafter, save it, optionally measure tau."""
    if args.export_prompts:
        write_jsonl_prompts(load_prompts(args.prompts), args.export_prompts)
        return 0
    started = time.perf_counter()
    state = PartialState(cpu=not torch.cuda.is_available())
    target, tokenizer = load_target(args.target, state.device)
    data = _regenerated_data(args, target, tokenizer, state)
    torch.manual_seed(args.seed)  # the drafter's initial weights
    drafter = new_drafter(
        target,
        num_layers=args.num_layers,
        block_size=args.block_size,
        mask_token_id=args.mask_token_id,
        tokenizer_size=len(tokenizer),
        target_layer_ids=args.target_layer_ids,
        init_from_target=args.init_from_target,
    )
    training_args = TrainingArguments(
        out_dir=args.out,
        steps=args.steps,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_ratio=args.warmup_ratio,
        max_length=args.max_length,
        max_anchors=args.max_anchors,
        gamma=args.gamma,
        seed=args.seed,
        save_every=args.save_every,
        # The limit covers the whole command: what loading and regenerating took is no longer left for training.
        time_limit_s=None if args.time_limit is None else args.time_limit - (time.perf_counter() - started),
        resume=args.resume,
        save_bf16=args.bf16,
        attention=args.attention,
        extra={"target": args.target, "prompts": args.prompts, "init_from_target": args.init_from_target,
               "regeneration_tokens_per_second": round(data.tokens_per_second, 1)},
    )
    result = train(target, drafter, data, training_args)
    if args.eval_prompts and state.is_main_process:
        drafter = DFlashDraftModel.from_pretrained(args.out).to(target.device, target.dtype)
        report = measure_tau(target, drafter, load_prompts(args.eval_prompts)[: args.eval_limit],
                             args.eval_max_new_tokens, tokenizer)
        record_path = Path(args.out) / "training_args.json"
        record = json.loads(record_path.read_text())
        record["eval"] = {"prompts": args.eval_prompts, "mean_tau": report.mean_tau,
                          "matches_greedy": report.matches_greedy}
        record_path.write_text(json.dumps(record, indent=2))
        print(f"eval tau {report.mean_tau:.2f} (greedy-identical: {report.matches_greedy})")
    print(f"saved {args.out}: {result.steps} steps, loss {result.final_loss:.3f}, tau {result.final_tau:.2f}, "
          f"{result.wall_time_s:.0f} s")
    return 0


def run_eval(args: argparse.Namespace) -> int:
    """`hf-dflash eval`: mean tau of a drafter on prompts, with a token-for-token check against plain greedy."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target, tokenizer = load_target(args.target, device)
    drafter = DFlashDraftModel.from_pretrained(args.drafter).to(device, target.dtype)
    start = time.perf_counter()
    report = measure_tau(target, drafter, load_prompts(args.prompts)[: args.limit], args.max_new_tokens, tokenizer)
    print(json.dumps({"mean_tau": report.mean_tau, "matches_greedy": report.matches_greedy,
                      "verify_steps": report.verify_steps, "seconds": round(time.perf_counter() - start, 1)}))
    return 0 if report.matches_greedy else 1


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `train` and `eval` subcommands."""
    p = subparsers.add_parser("train", help="train a DFlash drafter for a target", description=run.__doc__)
    p.add_argument("--target", required=True, help=f"model path or Hub id, or a bundled model: {', '.join(BUNDLED_TARGETS)}")
    p.add_argument("--prompts", default="sharegpt:20000",
                   help="a {'prompt': ...} jsonl (.gz too), 'sharegpt:N' (the first N distinct opening turns of "
                   "ShareGPT conversations), 'sharegpt-turns:N' (the first N distinct user turns) or 'humaneval'")
    p.add_argument("--regenerated", help="regenerated data file: reused if it exists, written otherwise "
                   "(default <out>/regenerated.safetensors)")
    p.add_argument("--export-prompts", metavar="JSONL",
                   help="only write the --prompts to this jsonl and exit (to carry to a machine without PyPI)")
    p.add_argument("--out", required=True, help="output directory of the drafter (and checkpoints)")
    p.add_argument("--num-layers", type=int, default=1, help="drafter decoder layers (published drafters: 5 or 8)")
    p.add_argument("--block-size", type=int, default=16, help="block size B, anchor included")
    p.add_argument("--mask-token-id", type=int,
                   help="embedding row for mask rows; default: the first row past the tokenizer, if there is one")
    p.add_argument("--target-layer-ids", type=_int_list, help="comma-separated target layers to capture")
    p.add_argument("--init-from-target", action="store_true",
                   help="start drafter layer i (and the final norm) from the target's where shapes match")
    p.add_argument("--max-new-tokens", type=int, default=1024, help="answer length cap when regenerating")
    p.add_argument("--max-prompt-tokens", type=int,
                   help="leave out prompts longer than this (chat template included) when regenerating")
    p.add_argument("--temperature", type=float, default=0.0, help="regeneration temperature (0: greedy)")
    p.add_argument("--gen-batch-size", type=int, default=16, help="prompts per regeneration batch")
    p.add_argument("--max-length", type=int, default=3072, help="training sequences are cut to this many tokens")
    p.add_argument("--max-anchors", type=int, default=512, help="anchors (blocks) per sequence")
    p.add_argument("--gamma", type=float, help="loss decay over block rows (default: 7 for B=16, 5 for 10, 4 for 8)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="optimizer steps (overrides --epochs)")
    length.add_argument("--epochs", type=float, default=6.0, help="passes over the data")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per process per step")
    p.add_argument("--lr", type=float, default=6e-4, help="peak AdamW learning rate (cosine schedule)")
    p.add_argument("--warmup-ratio", type=float, default=0.04, help="fraction of steps of linear warmup")
    p.add_argument("--seed", type=int, default=0, help="seed of regeneration, initialisation, data order, anchors")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: at the end only)")
    p.add_argument("--time-limit", type=float, metavar="SECONDS",
                   help="stop training once the command has run this long, with a checkpoint; rerun with --resume "
                        "to carry on (the learning-rate schedule still spans --steps)")
    p.add_argument("--resume", nargs="?", const="latest",
                   help="resume from a checkpoint directory (no value: the latest under <out>/checkpoints)")
    p.add_argument("--bf16", action="store_true", help="save the drafter's weights in bfloat16")
    p.add_argument("--attention", choices=["auto", "flex", "dense"], default="auto",
                   help="block attention in training: FlexAttention BlockMask, a dense boolean mask, or auto "
                   "(flex on GPU, dense on CPU)")
    p.add_argument("--eval-prompts", help="after training, measure tau on these prompts (same forms as --prompts)")
    p.add_argument("--eval-limit", type=int, default=20, help="how many eval prompts")
    p.add_argument("--eval-max-new-tokens", type=int, default=256, help="tokens generated per eval prompt")
    p.set_defaults(func=run)

    e = subparsers.add_parser("eval", help="measure a drafter's acceptance length tau", description=run_eval.__doc__)
    e.add_argument("--target", required=True, help=f"model path or Hub id, or one of {', '.join(BUNDLED_TARGETS)}")
    e.add_argument("--drafter", required=True, help="drafter directory")
    e.add_argument("--prompts", default="humaneval", help="a {'prompt': ...} jsonl, 'sharegpt:N' or 'humaneval'")
    e.add_argument("--limit", type=int, default=20, help="how many prompts")
    e.add_argument("--max-new-tokens", type=int, default=256, help="tokens generated per prompt")
    e.set_defaults(func=run_eval)


__all__ = ["load_target", "register", "run", "run_eval"]
