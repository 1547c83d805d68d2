"""The model card (README.md) written next to every saved or pushed DFlash drafter.

It states what a user needs to pair the drafter with its target (target model, captured layers, block size, mask
token), how to run it, and, when known, the training recipe (from the trainer's `training_args.json`) and the
acceptance length tau measured by whoever publishes it.

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

from typing import Any

# Recipe entries of training_args.json worth a line on the card, with their labels.
RECIPE_FIELDS = {
    "steps": "optimizer steps",
    "epochs": "epochs",
    "batch_size": "sequences per step",
    "lr": "learning rate (cosine, warmup ratio below)",
    "warmup_ratio": "warmup ratio",
    "max_length": "max sequence length",
    "max_anchors": "anchors per sequence",
    "gamma": "loss decay gamma (None: the published default for the block size)",
    "mixed_precision": "mixed precision",
    "device": "hardware",
    "wall_time_s": "training time (s)",
    "final_loss": "final loss",
}


def _parameters(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"


def _recipe_lines(training_args: dict[str, Any]) -> list[str]:
    lines = [f"- {label}: {training_args[key]}" for key, label in RECIPE_FIELDS.items() if key in training_args]
    data = training_args.get("data")
    if isinstance(data, dict) and data:
        lines.append("- data: " + ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in data.items()))
    if "final_tau" in training_args:
        # The trainer's tau is simulated on training batches, not measured by decoding; say so.
        lines.append(f"- tau simulated on the last training batches: {training_args['final_tau']:.2f}")
    if "command" in training_args:
        lines.append(f"- command: `{training_args['command']}`")
    return lines


def model_card(
    config: Any,
    num_parameters: int,
    repo_id: str | None = None,
    target_model: str | None = None,
    tau: float | None = None,
    training_args: dict[str, Any] | None = None,
) -> str:
    """README.md text for a drafter with `config`. `tau`: acceptance length measured by the publisher (tokens
    committed per verify step); `training_args`: the trainer's record (training_args.json), when there is one."""
    target = target_model or config.target_model
    # The trainer's record names the target as it was given on the command line (a path, Hub id or bundled name):
    # worth showing, but only a target given for the card goes into the Hub metadata (base_model) and the snippet.
    trained_on = (training_args or {}).get("target")
    repo = repo_id or "PATH_OR_REPO_OF_THIS_DRAFTER"
    target_shown = target or "TARGET (not recorded: pass target_model= when saving)"
    front = ["---", "library_name: transformers", "tags:", "- dflash", "- speculative-decoding"]
    if target:
        front.append(f"base_model: {target}")
    front.append("---")
    layers = config.target_layer_ids
    attention = ", ".join(sorted(set(config.layer_types)))
    rows = [
        ("target model", f"`{target}`" if target else f"`{trained_on}` (as given to the trainer)" if trained_on
         else "not recorded"),
        ("captured target layers (0-based outputs)", f"{layers} of {config.num_target_layers}"),
        ("block size (anchor + mask rows)", str(config.block_size)),
        ("mask token id", str(config.mask_token_id)),
        ("target vocabulary / hidden size", f"{config.vocab_size} / {config.target_hidden_size}"),
        ("draft vocabulary", f"{config.draft_vocab_size} tokens (`draft_vocab.safetensors`)" if config.draft_vocab_size
         else "the target's whole vocabulary"),
        (
            "drafter",
            f"{config.num_hidden_layers} layers ({attention}), hidden {config.hidden_size}, "
            f"{config.num_attention_heads}/{config.num_key_value_heads} heads of {config.head_dim}, "
            f"intermediate {config.intermediate_size}",
        ),
        ("parameters", _parameters(num_parameters)),
        ("measured tau (tokens per verify step)", f"{tau:.2f}" if tau is not None else "not measured"),
    ]
    body = [
        f"# DFlash drafter for {target or 'its target model'}",
        "",
        "A [DFlash](https://arxiv.org/abs/2602.06036) block-diffusion drafter for lossless speculative decoding: one "
        f"forward drafts {config.block_size - 1} tokens, reading hidden states captured from the target's layers; "
        "the target verifies the block in one forward. It has no embedding and no lm_head of its own (it borrows "
        "the target's), so it only works with the target below.",
        "",
        "| | |",
        "| --- | --- |",
        *[f"| {name} | {value} |" for name, value in rows],
        "",
        "## Use",
        "",
        "Greedy output is token-for-token the target's own; sampled output follows the target's distribution. "
        "Pin the revision whose remote code you have read.",
        "",
        "```python",
        "import torch",
        "from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer",
        "",
        f'target = AutoModelForCausalLM.from_pretrained("{target_shown}", dtype=torch.bfloat16, device_map="cuda")',
        f'tokenizer = AutoTokenizer.from_pretrained("{target_shown}")',
        f'drafter = AutoModel.from_pretrained("{repo}", trust_remote_code=True, revision="COMMIT_SHA",',
        '                                    dtype=torch.bfloat16).to("cuda")',
        'inputs = tokenizer("Write a quicksort in Python.", return_tensors="pt").to("cuda")',
        "out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=256)",
        "```",
        "",
        "With the `hf-dflash` library installed, `hf_dflash.DFlashDraftModel.from_pretrained` loads it without remote "
        "code, and `hf-dflash info DRAFTER --target TARGET` checks that a target fits.",
    ]
    if training_args:
        body += ["", "## Training recipe", "", "From the trainer's record (training_args.json, saved alongside):", ""]
        body += _recipe_lines(training_args)
    return "\n".join(front + [""] + body) + "\n"


__all__ = ["model_card"]
