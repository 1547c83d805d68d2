"""`hf-dflash train` and `hf-dflash eval`: the training recipe and the acceptance check from the command line.

    hf-dflash train --target stories260k --mask-token-id 0 --prompts prompts.jsonl --out my-drafter
    accelerate launch -m hf_dflash.cli train --target /models/Qwen3-8B --prompts sharegpt.jsonl --out q3-drafter
    hf-dflash eval --target stories260k --drafter my-drafter --prompts prompts.jsonl --limit 8

`register(subparsers)` adds both subcommands to the top-level parser; each sets `func` to its `run` function.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from accelerate import PartialState
from safetensors import SafetensorError
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .. import generate_cli
from ..cli_checks import BUNDLED_TARGETS, add_threads_option
from ..modeling import DFlashConfig, DFlashDraftModel
from ..run_record import device_name, portable_command, portable_path
from .data import AnswersOrigin, RegeneratedData, load_prompts, prompt_sources, regenerate, write_jsonl_prompts
from .drafter import ARCHITECTURES, DEFAULT_BLOCK_SIZES, grow_drafter, new_drafter, upgrade_to_dflash2
from .evaluate import measure_tau
from .trainer import TrainingArguments, train


def load_target(spec: str, device: torch.device | str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A target by path or Hub id, or a bundled offline model by name (as `generate` loads it); bfloat16 on GPU,
    float32 on CPU."""
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return generate_cli.load_target(spec, dtype, str(device))


def answers_paths(args: argparse.Namespace) -> list[Path]:
    """The answers file of each --prompts set: its --regenerated file, or <out>/regenerated.safetensors for one set."""
    if args.regenerated:
        return [Path(path) for path in args.regenerated]
    return [Path(args.out) / "regenerated.safetensors"]


def target_identity(spec: str) -> str:
    """How an answers file names the target that wrote it: a bundled model's name or a Hub id as given; a folder by its
    name and its config.json's sha256 (so a copy of the same model elsewhere is the same target)."""
    folder = Path(spec).expanduser()
    if spec in BUNDLED_TARGETS or not folder.is_dir():
        return spec
    digest = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()
    return f"{folder.resolve().name} (config.json sha256 {digest[:16]})"


def answers_origin(spec: str, args: argparse.Namespace) -> AnswersOrigin:
    """What this run's answers to the prompt set `spec` are made from."""
    return AnswersOrigin.of_run(load_prompts(spec), target_identity(args.target), args.max_new_tokens,
                                args.max_prompt_tokens, args.temperature, args.seed)


def _regenerated_data(args: argparse.Namespace, target, tokenizer, state: PartialState) -> RegeneratedData:
    """The regenerated data of every --prompts set, joined in order: each set's answers file is reused if it was made
    from this run's prompts, target and options, else written (so a new set is answered alone and trained on beside
    the sets answered before)."""
    sets = [_regenerated_set(spec, path, args, target, tokenizer, state)
            for spec, path in zip(args.prompts, answers_paths(args))]
    data = RegeneratedData.concat(sets)
    # concat adds the speeds of shards that ran side by side; these sets were answered one after another.
    seconds = sum(s.num_response_tokens / s.tokens_per_second for s in sets if s.tokens_per_second)
    data.tokens_per_second = data.num_response_tokens / seconds if seconds else 0.0
    return data


def _recorded_origin(path: Path) -> AnswersOrigin | None:
    """What the answers file at `path` records of its origin; None when it records nothing, does not exist, or (let
    through by `check_train` only under --overwrite, which answers again) cannot be read."""
    if not path.is_file():
        return None
    try:
        return AnswersOrigin.of_file(path)
    except (OSError, ValueError, TypeError, SafetensorError):
        return None


def _regenerated_set(spec: str, path: Path, args: argparse.Namespace, target, tokenizer, state: PartialState):
    """Reuse `path` if it was made from the same work (or, with --adopt-regenerated, if it records nothing);
    otherwise every process answers its share of the prompts of `spec`. `cli_checks.check_train` has refused any
    other file unless --overwrite was given."""
    origin = answers_origin(spec, args)
    recorded = _recorded_origin(path)
    if recorded == origin or (recorded is None and path.is_file() and args.adopt_regenerated):
        data = RegeneratedData.load(path)
        if len(data) == 0:  # a file written before empty ones were refused
            raise ValueError(f"{path} holds no sequences; pass --overwrite to answer --prompts {spec} again")
        state.wait_for_everyone()  # every process has read it
        if state.is_main_process:
            if recorded is None:  # adopted: recorded now, so a later run reuses it without --adopt-regenerated
                data.origin = origin
                data.save(path)
            print(f"reusing {path}: {len(data)} sequences, {data.num_response_tokens} answer tokens, answered before "
                  "with these prompts, this target and these options")
        state.wait_for_everyone()
        return data
    prompts = load_prompts(spec)
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
    parts = [path.with_suffix(f".part{i}.safetensors") for i in range(state.num_processes)]
    data = RegeneratedData.concat([RegeneratedData.load(p) for p in parts])
    if len(data) == 0:  # every process sees it, so none waits for the others below
        raise ValueError(f"--prompts {spec}: the target answered none of its {len(prompts)} prompts (each answer ended "
                         "at its first token); nothing to train on: check the prompts and the target's chat template")
    state.wait_for_everyone()  # every process has read the parts
    if state.is_main_process:
        data.origin = origin
        data.save(path)
        for p in parts:
            p.unlink()
        print(f"regenerated {len(data)} sequences, {data.num_response_tokens} answer tokens, "
              f"{data.tokens_per_second:.0f} tokens/s -> {path}")
    state.wait_for_everyone()
    return RegeneratedData.load(path)


def _history(drafter_dir: str) -> list[dict]:
    """The runs recorded in a drafter's training_args.json, oldest first (a record from before histories were kept
    counts as one run)."""
    path = Path(drafter_dir) / "training_args.json"
    if not path.is_file():
        return []
    record = json.loads(path.read_text())
    if "history" in record:
        return record["history"]
    keys = ("command", "steps", "anchor_blocks", "wall_time_s", "device", "data", "final_loss", "final_tau", "eval",
            "tau")
    return [{k: record[k] for k in keys if k in record}]


def _earlier_runs(args: argparse.Namespace) -> list[dict]:
    """The runs before this one that shaped the weights it starts from: on --resume those the resumed run recorded in
    --out (its own entry left out: this run writes it again, a resumed run being the same run), else --init-from's."""
    if args.resume is not None and _history(args.out):
        return _history(args.out)[:-1]
    return _history(args.init_from) if args.init_from else []


def _clear_replaced_run(out: Path) -> None:
    """--overwrite: the replaced drafter's checkpoints and curve go before the new run writes its own (save_pretrained
    replaces its weights and config, the new training_args.json its record); the answers files stay."""
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    (out / "train_log.jsonl").unlink(missing_ok=True)


def run(args: argparse.Namespace) -> int:
    """`hf-dflash train`: regenerate (or reuse) data, train a drafter, save it, optionally measure tau."""
    if args.export_prompts:
        write_jsonl_prompts([p for spec in args.prompts for p in load_prompts(spec)], args.export_prompts)
        return 0
    # cli_checks.check_train has checked --init-from against the options that would change its shape
    depth = DFlashConfig.from_pretrained(args.init_from).num_hidden_layers if args.init_from else 0
    grow = bool(args.init_from) and args.num_layers is not None and args.num_layers > depth
    started = time.perf_counter()
    state = PartialState(cpu=not torch.cuda.is_available())
    target, tokenizer = load_target(args.target, state.device)
    data = _regenerated_data(args, target, tokenizer, state)
    if args.regenerate_only:
        return 0
    torch.manual_seed(args.seed)  # the drafter's initial weights
    if args.init_from:
        # Weights in float32 whatever they were saved in: the optimizer keeps float32 master weights.
        drafter = DFlashDraftModel.from_pretrained(args.init_from, dtype=torch.float32)
        if grow:
            grow_drafter(drafter, args.num_layers)
        if args.arch == "dflash2" and not drafter.config.is_dflash2:
            drafter = upgrade_to_dflash2(drafter)
    else:
        drafter = new_drafter(
            target,
            num_layers=args.num_layers or 1,
            block_size=args.block_size,
            mask_token_id=args.mask_token_id,
            tokenizer_size=len(tokenizer),
            target_layer_ids=args.target_layer_ids,
            init_from_target=args.init_from_target,
            arch=args.arch or "dflash",
        )
    arch = "dflash2" if drafter.config.is_dflash2 else "dflash"
    if args.draft_vocab_size is not None:
        # The drafter is trained over the full vocabulary; the saved one drafts over the answers' most used tokens.
        vocabulary = data.most_frequent_response_tokens(args.draft_vocab_size, drafter.config.vocab_size)
        drafter.set_draft_vocabulary(vocabulary)
    if state.is_main_process:
        # The size a shipped drafter's bf16 model.safetensors has (MB: 10^6 bytes); the budget is a shipping rule.
        parameters = sum(p.numel() for p in drafter.parameters())
        origin = f"{args.init_from}, grown from {depth} layers" if grow else args.init_from or "new"
        kind = "DFlash2 drafter" if arch == "dflash2" else "drafter"
        print(f"{kind} ({origin}): {drafter.config.num_hidden_layers} layers, {parameters:,} parameters, "
              f"{2 * parameters / 1e6:.2f} MB of bf16 weights")
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
        max_shard_size=args.max_shard_size,
        group_by_length=args.group_by_length,
        distill_topk=args.distill_topk,
        distill_weight=args.distill_weight,
        log_every=args.log_every,
        compile_loss={"auto": None, "on": True, "off": False}[args.compile_loss],
        attention=args.attention,
        extra={"command": portable_command(sys.argv), "arch": arch,
               "target": args.target_description or args.target,
               "prompts": " ".join(map(portable_path, args.prompts)), "init_from_target": args.init_from_target,
               "init_from": args.init_from and portable_path(args.init_from),
               "data": {"prompt_sources": dict(sum((Counter(prompt_sources(spec)) for spec in args.prompts),
                                                   Counter()))},
               "regeneration_tokens_per_second": round(data.tokens_per_second, 1),
               "history": _earlier_runs(args),
               **({"draft_vocab_size": args.draft_vocab_size} if args.draft_vocab_size else {}),
               **({"grown": {"from_layers": depth, "to_layers": args.num_layers}} if grow else {})},
    )
    if args.overwrite and state.is_main_process:
        _clear_replaced_run(Path(args.out))
    state.wait_for_everyone()
    result = train(target, drafter, data, training_args)
    if args.eval_prompts and state.is_main_process:
        drafter = DFlashDraftModel.from_pretrained(args.out).to(target.device, target.dtype)
        report = measure_tau(target, drafter, load_prompts(args.eval_prompts)[: args.eval_limit],
                             args.eval_max_new_tokens, tokenizer)
        record_tau(args.out, {"prompts": portable_path(args.eval_prompts), "limit": args.eval_limit,
                              "max_new_tokens": args.eval_max_new_tokens, "mean_tau": report.mean_tau,
                              "matches_greedy": report.matches_greedy, **_where(target)})
        print(f"eval tau {report.mean_tau:.2f} (greedy-identical: {report.matches_greedy})")
    if state.is_main_process:  # one line per run, not per process (the main process saves)
        print(f"saved {args.out}: {result.steps} steps, loss {result.final_loss:.3f}, tau {result.final_tau:.2f}, "
              f"{result.wall_time_s:.0f} s")
    return 0


def _where(target: PreTrainedModel) -> dict[str, str]:
    return {"device": device_name(target.device), "dtype": str(target.dtype).removeprefix("torch.")}


def record_tau(drafter_dir: str | Path, measurement: dict) -> None:
    """Add a tau measurement to the last run of the drafter's training_args.json (its "history"), and as "eval"."""
    path = Path(drafter_dir) / "training_args.json"
    record = json.loads(path.read_text())
    record["eval"] = measurement
    if record.get("history"):
        record["history"][-1].setdefault("tau", []).append(measurement)
    path.write_text(json.dumps(record, indent=2))


def run_eval(args: argparse.Namespace) -> int:
    """`hf-dflash eval`: mean tau of a drafter on prompts, with a token-for-token check against plain greedy (exit
    status 1 when a float32 run differs; in bfloat16, a GPU's default here, a near tie may round either way)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    prompts = load_prompts(args.prompts)[: args.limit]  # before the models: a bad file fails at once
    target, tokenizer = load_target(args.target, device)
    drafter = DFlashDraftModel.from_pretrained(args.drafter).to(device, target.dtype)
    start = time.perf_counter()
    report = measure_tau(target, drafter, prompts, args.max_new_tokens, tokenizer)
    result = {"mean_tau": report.mean_tau, "matches_greedy": report.matches_greedy,
              "verify_steps": report.verify_steps, "seconds": round(time.perf_counter() - start, 1)}
    print(json.dumps(result))
    if args.record:
        record_tau(args.drafter, {"prompts": portable_path(args.prompts), "limit": args.limit,
                                  "max_new_tokens": args.max_new_tokens, "mean_tau": report.mean_tau,
                                  "matches_greedy": report.matches_greedy, **_where(target)})
    return 0 if report.matches_greedy or target.dtype != torch.float32 else 1


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `train` and `eval` subcommands."""
    p = subparsers.add_parser("train", help="train a DFlash drafter for a target", description=run.__doc__)
    p.add_argument("--target", required=True, help=f"model path or Hub id, or a bundled model: {', '.join(BUNDLED_TARGETS)}")
    p.add_argument("--prompts", nargs="+", default=["sharegpt:20000"],
                   help="one or more prompt sets, each a {'prompt': ...} jsonl (.gz too), 'sharegpt:N' (the first N "
                   "distinct opening turns of ShareGPT conversations), 'sharegpt-turns:N' (the first N distinct user "
                   "turns) or 'humaneval'; training takes them all")
    p.add_argument("--regenerated", nargs="+",
                   help="regenerated data file of each --prompts set, in the same order: reused if it was made from "
                   "the same prompts, target and generation options (each file records them), written if it does not "
                   "exist (default, for one set: <out>/regenerated.safetensors)")
    p.add_argument("--overwrite", action="store_true",
                   help="answer again the prompt sets whose answers file was made from other work, and replace a "
                   "drafter already in --out (its checkpoints and train_log.jsonl go)")
    p.add_argument("--adopt-regenerated", action="store_true",
                   help="reuse answers files that record nothing of what they were made from (written by an earlier "
                   "hf-dflash) as this run's, and record that in them")
    p.add_argument("--export-prompts", metavar="JSONL",
                   help="only write the --prompts to this jsonl and exit (to carry to a machine without PyPI)")
    p.add_argument("--out", required=True, help="output directory of the drafter (and checkpoints)")
    p.add_argument("--regenerate-only", action="store_true",
                   help="only regenerate the data (to --regenerated, or <out>/regenerated.safetensors) and exit")
    p.add_argument("--target-description",
                   help="what the target is, for the recipe (e.g. where a bundled model comes from)")
    p.add_argument("--init-from", metavar="DRAFTER",
                   help="continue from this drafter's weights and shape (a fresh optimizer); its recorded runs "
                   "become this drafter's history")
    p.add_argument("--num-layers", type=int,
                   help="drafter decoder layers (default 1; published drafters: 5 or 8); with --init-from, grow that "
                   "drafter to this many: each new layer a copy of its last with the output projections of "
                   "attention and MLP zeroed, so it starts out computing exactly what the drafter did")
    p.add_argument("--arch", choices=list(ARCHITECTURES),
                   help="the drafter's architecture: dflash (default), or dflash2 (convolutions along the block and a "
                   "candidate selector, with the published DFlash2 settings; trained with the block loss plus the "
                   "selector's); with --init-from, that drafter's, or dflash2 to upgrade a DFlash drafter: it starts "
                   "out drafting as that drafter did (identity convolutions, a silent selector)")
    p.add_argument("--block-size", type=int, default=None,
                   help="block size B, anchor included (default "
                   + ", ".join(f"{size} for {arch}" for arch, size in DEFAULT_BLOCK_SIZES.items())
                   + "; with --init-from, that drafter's)")
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
    p.add_argument("--gamma", type=float, help="loss decay over block rows (default: 7 for B=16, 5 for 10, 4 for 8, "
                   "linear between them, 4 below 8 and 7 above 16)")
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
    p.add_argument("--max-shard-size", help="save the weights in shards of at most this size (e.g. 15MB)")
    p.add_argument("--group-by-length", action="store_true",
                   help="batches of sequences of similar answer length, in random order (less padding)")
    p.add_argument("--distill-topk", type=int, default=0,
                   help="also learn the target's top-k distribution at each labelled row (0: hard labels only)")
    p.add_argument("--distill-weight", type=float, default=0.5,
                   help="weight of that distribution against the hard label")
    p.add_argument("--log-every", type=int, default=50, help="steps per line of <out>/train_log.jsonl")
    p.add_argument("--compile-loss", choices=["auto", "on", "off"], default="auto",
                   help="the loss's element-wise work through torch.compile (auto: on GPU)")
    p.add_argument("--attention", choices=["auto", "flex", "dense"], default="auto",
                   help="block attention in training: FlexAttention BlockMask, a dense boolean mask, or auto "
                   "(flex on GPU, dense on CPU)")
    p.add_argument("--draft-vocab-size", type=int, metavar="K",
                   help="the saved drafter drafts over the K tokens its training answers use most (a reduced draft "
                        "vocabulary: cheaper drafting, same output); default: the full vocabulary")
    p.add_argument("--eval-prompts", help="after training, measure tau on these prompts (same forms as --prompts)")
    p.add_argument("--eval-limit", type=int, default=20, help="how many eval prompts")
    p.add_argument("--eval-max-new-tokens", type=int, default=256, help="tokens generated per eval prompt")
    add_threads_option(p)
    p.set_defaults(func=run)

    e = subparsers.add_parser("eval", help="measure a drafter's acceptance length tau", description=run_eval.__doc__)
    e.add_argument("--target", required=True, help=f"model path or Hub id, or one of {', '.join(BUNDLED_TARGETS)}")
    e.add_argument("--drafter", required=True, help="drafter directory")
    e.add_argument("--prompts", default="humaneval", help="a {'prompt': ...} jsonl, 'sharegpt:N' or 'humaneval'")
    e.add_argument("--limit", type=int, default=20, help="how many prompts")
    e.add_argument("--max-new-tokens", type=int, default=256, help="tokens generated per prompt")
    e.add_argument("--record", action="store_true",
                   help="add the measurement to the drafter's training_args.json (its last run's tau)")
    add_threads_option(e)
    e.set_defaults(func=run_eval)


__all__ = ["load_target", "register", "run", "run_eval"]
