"""Data-parallel batch generation: the prompts are shared out over the launched processes, each process decodes its
share in batches (DFlash, or plain generate without a drafter) on its own device, and the answers are gathered in
prompt order.

    state = distributed_state()                      # first: it tells each process its device
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.bfloat16).to(state.device)
    drafter = DFlashDraftModel.from_pretrained(DRAFTER, dtype=torch.bfloat16).to(state.device)
    texts = generate_data_parallel(target, drafter, prompts, tokenizer, batch_size=16, decode=True, max_new_tokens=256)

The same script runs unchanged in one process (`python script.py`), on the GPUs of one node (`accelerate launch
--multi_gpu --num_processes 8 script.py`, or `torchrun --nproc_per_node 8 script.py`), on several nodes (`accelerate
launch --multi_gpu --num_machines 2 --num_processes 16 --machine_rank R --main_process_ip HOST --main_process_port
PORT script.py` on each), and as several CPU processes (`torchrun --nproc_per_node 2 script.py`: they join one gloo
group). `accelerate launch --cpu --num_processes 2` is not a way to get two CPU processes: it starts one (it expects
mpirun).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .batching import generate_in_batches, left_pad_token_id
from .training.data import encode_prompt


def distributed_state() -> PartialState:
    """This process's place in the launch: rank, number of processes, and the device to load its models on.

    Call it before loading the models. Without a GPU, accelerate joins the launched processes into one (gloo) group
    only when asked for a CPU state; otherwise every process would believe it is alone and decode every prompt.
    """
    return PartialState(cpu=not torch.cuda.is_available())


def generate_data_parallel(
    target: PreTrainedModel,
    drafter: torch.nn.Module | None,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    tokenizer: PreTrainedTokenizerBase | None = None,
    batch_size: int = 8,
    decode: bool = False,
    **generate_kwargs: object,
) -> list[list[int]] | list[str]:
    """Answer every prompt, sharing the prompts out over the launched processes; returns the answers in prompt order
    on every process (`decode=False`: new token ids up to and including the first eos; `decode=True`: their text).

    Each process must hold its own target and drafter on its own device (`distributed_state().device`), or a target
    that `device_map` spreads over devices of its own. Text prompts are encoded like the training and eval prompts
    (the chat template when the tokenizer has one) and need `tokenizer`; token-id prompts are used as they are.
    `drafter=None` decodes with plain generate (the baseline). `generate_kwargs` go to every `generate` call; under
    sampling, seed each process differently (`transformers.set_seed(seed + state.process_index)`).
    A progress bar shows the main process's share.
    """
    state = distributed_state()
    text_prompts = any(isinstance(p, str) for p in prompts)
    if text_prompts and tokenizer is None:
        raise ValueError("text prompts need the tokenizer: pass tokenizer=..., or give token-id lists")
    if decode and tokenizer is None:
        raise ValueError("decode=True needs the tokenizer: pass tokenizer=...")
    # Accelerators only: every CPU process computes on "cpu" (accelerate calls it cpu:0).
    accelerator = state.device.type != "cpu" and getattr(target, "hf_device_map", None) is None
    if state.num_processes > 1 and accelerator and target.device != state.device:
        raise ValueError(
            f"process {state.process_index} holds its target on {target.device}, but its device is {state.device}: "
            "load the models with .to(distributed_state().device) so that every process uses its own device"
        )
    pad_token_id = generate_kwargs.pop("pad_token_id", None)
    pad_token_id = left_pad_token_id(tokenizer, target) if pad_token_id is None else int(pad_token_id)
    # Contiguous shares, so gathering them in process order gives the prompts' order back.
    with state.split_between_processes(list(range(len(prompts)))) as indices:
        token_ids = [encode_prompt(tokenizer, prompts[i]) if text_prompts else list(prompts[i]) for i in indices]
        answers = generate_in_batches(
            target,
            token_ids,
            pad_token_id,
            batch_size,
            drafter=drafter,
            progress=state.is_main_process,
            desc=f"generate (process 0 of {state.num_processes}, {len(indices)} of {len(prompts)} prompts)",
            **generate_kwargs,
        )
    answers = gather_object(answers)  # every process's list, concatenated in process order (as is, when alone)
    return tokenizer.batch_decode(answers, skip_special_tokens=True) if decode else answers


__all__ = ["distributed_state", "generate_data_parallel"]
