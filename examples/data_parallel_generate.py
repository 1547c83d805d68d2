"""Data-parallel DFlash generation: stories260K answers many prompts, shared out over the launched processes.

    python examples/data_parallel_generate.py                                       # one process
    torchrun --nproc_per_node 2 examples/data_parallel_generate.py                  # two processes (CPU: gloo)
    accelerate launch --multi_gpu --num_processes 2 examples/data_parallel_generate.py   # the same, via accelerate

On N GPUs, `--num_processes N` (or `--nproc_per_node N`); each process decodes its share of the prompts in batches on
its own GPU and the main process prints the answers in prompt order. (`accelerate launch --cpu --num_processes 2`
starts a single process: use torchrun or `--multi_gpu` for several CPU processes.)

The drafter is a seeded random one unless `--drafter DIR` names a trained one (examples/train_stories260k.py writes
stories260k-drafter/): a random drafter's drafts are rarely accepted, but the output is the same either way.
"""

import argparse

import torch

from hf_dflash import DFlashConfig, DFlashDraftModel
from hf_dflash.bundled_models import load_stories260k
from hf_dflash.parallel import distributed_state, generate_data_parallel

parser = argparse.ArgumentParser(description="data-parallel DFlash generation with stories260K")
parser.add_argument("--drafter", default=None, help="a trained drafter directory (default: a random one)")
parser.add_argument("--batch-size", type=int, default=4)
parser.add_argument("--max-new-tokens", type=int, default=48)
args = parser.parse_args()

state = distributed_state()  # before loading: it gives this process its device
target, tokenizer = load_stories260k(device=state.device)
if args.drafter:
    drafter = DFlashDraftModel.from_pretrained(args.drafter).to(state.device)
else:
    torch.manual_seed(0)  # the same drafter in every process
    config = DFlashConfig.for_target(target.config, num_hidden_layers=1, block_size=8, mask_token_id=0)
    drafter = DFlashDraftModel(config).to(state.device)
drafter.eval()

names = ["Lily", "Tom", "Sue", "Max", "Ben", "Anna"]
prompts = [f"Once upon a time, {name} went to {place}." for name in names for place in ("the park", "the sea")]
settings = dict(batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, do_sample=False)
stories = generate_data_parallel(target, drafter, prompts, tokenizer, decode=True, **settings)
plain = generate_data_parallel(target, None, prompts, tokenizer, decode=True, **settings)

if state.is_main_process:
    for prompt, story in zip(prompts, stories):
        print(f"{prompt} {story}\n")
    print(f"{len(prompts)} prompts over {state.num_processes} process(es); identical to plain generate: {stories == plain}")
state.destroy_process_group()  # leave the process group cleanly before exit
