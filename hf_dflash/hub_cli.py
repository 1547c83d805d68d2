"""`hf-dflash convert`, `hf-dflash push` and `hf-dflash info`: drafters on disk and on the Hub.

    hf-dflash info z-lab/Qwen3-8B-DFlash-b16 --target Qwen/Qwen3-8B
    hf-dflash convert z-lab-drafter/ our-drafter/ --to ours
    hf-dflash convert our-drafter/ for-vllm/ --to speculators --target Qwen/Qwen3-8B
    hf-dflash push my-drafter/ my-org/my-drafter --tau 4.2

`register(subparsers)` adds the three subcommands to the top-level parser; each sets `func` to its `run_*` function.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from . import convert as conversion
from .cli_checks import BUNDLED_TARGETS
from .hub import published_drafters
from .modeling import DFlashConfig, DFlashDraftModel
from .modeling.dflash_checks import fit_problems
from .modeling.dflash_layouts import read_config_file
from .modeling.modeling_dflash2 import DFlash2DraftModel


def run_convert(args: argparse.Namespace) -> int:
    """The arguments were checked by `cli_checks.check_convert`; a conversion error reaches the user as one line."""
    src, out = Path(args.src), Path(args.out)
    conversion.convert(src, out, args.to, target=args.target, progress=True)
    source_layout = conversion.detect_format(read_config_file(src))
    print(f"{src} ({source_layout}) -> {out} ({args.to})")
    return 0


def run_push(args: argparse.Namespace) -> int:
    drafter = DFlashDraftModel.from_pretrained(args.drafter)
    card = dict(target_model=args.target_model, tau=args.tau)
    if args.dry_run:
        drafter.save_pretrained(args.dry_run, repo_id=args.repo_id, **card)
        how = [word for word, on in (("a new private repository if it does not exist", args.private),
                                     (f"branch {args.revision}", args.revision),
                                     ("as a pull request", args.create_pr),
                                     (f"message {args.commit_message!r}", args.commit_message)) if on]
        print(f"wrote the folder that would be pushed to {args.repo_id} into {args.dry_run}"
              + (f" ({', '.join(how)})" if how else ""))
        return 0
    commit = drafter.push_to_hub(
        args.repo_id, private=args.private, revision=args.revision, create_pr=args.create_pr,
        commit_message=args.commit_message, **card,
    )
    print(f"pushed {args.drafter} to {args.repo_id}: {getattr(commit, 'commit_url', commit)}")
    return 0


def _read_drafter(name: str) -> tuple[DFlashConfig, str, str, dict[str, Any]]:
    """(our config, layout, where its weights are, its training record or {}) for a local folder of any layout or a
    Hub id (offline: the Hub cache, else the published config in hub_configs/)."""
    folder = Path(name)
    if folder.is_dir():
        config = read_config_file(folder)
        has_weights = any(folder.glob("*.safetensors"))
        record = folder / "training_args.json"
        return conversion.config_from_layout(config), conversion.detect_format(config), (
            "present" if has_weights else "missing from the folder"
        ), json.loads(record.read_text()) if record.is_file() else {}
    from huggingface_hub import try_to_load_from_cache

    config = DFlashConfig.from_pretrained(name)
    weights = "cached" if _weights_cached(name) else "not on this machine (from_pretrained downloads them from the Hub)"
    record = try_to_load_from_cache(name, "training_args.json")
    return config, "Hub", weights, json.loads(Path(record).read_text()) if isinstance(record, str) else {}


def _weights_cached(name: str) -> bool:
    """Whether the Hub cache holds every weights file of `name`: model.safetensors, or each shard its index lists."""
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "model.safetensors"), str):
        return True
    index = try_to_load_from_cache(name, "model.safetensors.index.json")
    if not isinstance(index, str):
        return False
    shards = set(json.loads(Path(index).read_text())["weight_map"].values())
    return all(isinstance(try_to_load_from_cache(name, shard), str) for shard in shards)


def recorded_target(config: DFlashConfig, training_args: dict[str, Any]) -> str:
    """The target a drafter says it belongs to: its config's `target_model`, else the trainer's record."""
    if config.target_model:
        return config.target_model
    target = training_args.get("target")
    if not target:
        return "not recorded"
    bundled = f": hf-dflash's bundled {BUNDLED_TARGETS[target]}" if target in BUNDLED_TARGETS else ""
    return f"{target} (recorded in training_args.json){bundled}"


def _read_target(name: str) -> tuple[Any, int | None, int | None]:
    """(config, embedding rows, lm_head rows) of a target; rows are known only for the bundled offline models."""
    if name in BUNDLED_TARGETS:
        from .generate_cli import load_target

        model, _ = load_target(name, torch.float32, "cpu")
        return model.config, model.get_input_embeddings().weight.shape[0], model.get_output_embeddings().weight.shape[0]
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(name), None, None


def run_info(args: argparse.Namespace) -> int:
    config, layout, weights, training_args = _read_drafter(args.drafter)
    model_class = DFlash2DraftModel if config.is_dflash2 else DFlashDraftModel
    with torch.device("meta"):
        parameters = sum(p.numel() for p in model_class(config).parameters())
    attention = ", ".join(f"{config.layer_types.count(t)} {t}" for t in sorted(set(config.layer_types)))
    print(f"drafter     {args.drafter} ({layout}; weights {weights})")
    print(f"target      {recorded_target(config, training_args)}")
    print(
        f"shape       {config.num_hidden_layers} layers ({attention}), hidden {config.hidden_size}, "
        f"{config.num_attention_heads}/{config.num_key_value_heads} heads of {config.head_dim}, intermediate "
        f"{config.intermediate_size}; {parameters / 1e6:.1f}M parameters"
    )
    print(
        f"captures    target layers {config.target_layer_ids} of {config.num_target_layers} "
        f"(width {config.target_hidden_size})"
    )
    print(f"block       {config.block_size}, mask token {config.mask_token_id}, vocabulary {config.vocab_size}")
    if config.is_dflash2:
        softcap = config.final_logit_softcapping
        cap = "no cap" if softcap is None else f"soft-capped at {softcap:g}"
        print(
            f"DFlash2     convolutions of {config.conv_kernel_size} taps over groups of {config.conv_group_size} "
            f"channels; selector of rank {config.selector_rank} over {config.selector_top_k} candidates; logits x "
            f"{config.output_multiplier:g}, {cap}; block embeddings x {config.input_embedding_scale:g}"
        )
    published = published_drafters().get(args.drafter)
    if published is not None:
        print(f"published   https://huggingface.co/{published.repo_id}/blob/main/config.json")
        print(f"values from {published.source}")
        for note in published.unverified:
            print(f"unverified  {note}")
    if not args.target:
        return 0
    target_config, embedding_rows, lm_head_rows = _read_target(args.target)
    problems = fit_problems(config, target_config, embedding_rows, lm_head_rows)
    if problems:
        print(f"DOES NOT FIT {args.target}:")
        for problem in problems:
            print(f"  - {problem}")
        return 1
    print(f"fits        {args.target}")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="convert a drafter between layouts: ours, zlab, native (Muse Glimmer), speculators (vLLM)",
        description=conversion.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("src", help="checkpoint folder of any layout (detected from its config.json)")
    parser.add_argument("out", help="new folder for the converted drafter")
    parser.add_argument("--to", required=True, choices=conversion.FORMATS, help="layout to write")
    parser.add_argument("--target", default=None,
                        help="target path or Hub id; needed for --to speculators (it stores the target's embedding "
                             "and lm_head)")
    parser.set_defaults(func=run_convert)

    parser = subparsers.add_parser(
        "push",
        help="publish a drafter folder on the Hub (weights, config, remote code, model card, generation config)",
        description="Upload exactly what save_pretrained writes: safetensors weights, config.json with auto_map, the "
                    "remote-code bundle, a README.md model card and generation_config.json (plus training_args.json "
                    "when the folder has one). Log in first with `hf auth login`.",
    )
    parser.add_argument("drafter", help="drafter folder (ours, zlab or native layout)")
    parser.add_argument("repo_id", help="Hub repository, e.g. my-org/Qwen3-8B-DFlash")
    parser.add_argument("--target-model", default=None, help="the target's Hub id, for the card (else the config's)")
    parser.add_argument("--tau", type=float, default=None, help="acceptance length you measured, for the card")
    parser.add_argument("--private", action="store_true", help="create the repository private")
    parser.add_argument("--revision", default=None, help="branch to push to")
    parser.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing")
    parser.add_argument("--commit-message", default=None)
    parser.add_argument("--dry-run", metavar="DIR", default=None,
                        help="write the folder that would be uploaded into DIR and upload nothing")
    parser.set_defaults(func=run_push)

    parser = subparsers.add_parser(
        "info",
        help="describe a drafter and check that it fits a target",
        description="Print a drafter's shape, captured layers, block size and mask token (a folder of any layout, "
                    "or a Hub id: published drafters' configs are known offline), and with --target check that it "
                    "fits that target (hidden size, layers, vocabulary, mask token). Exit status 1 when it does not.",
    )
    parser.add_argument("drafter", help="drafter folder or Hub id")
    parser.add_argument("--target", default=None,
                        help="target path or Hub id (its config.json is enough), or smollm2 | stories260k")
    parser.set_defaults(func=run_info)


__all__ = ["register"]
