"""Run by tests/test_parallel.py, alone or under torchrun: greedy data-parallel DFlash decoding of tiny random models.

    python tests/data_parallel_worker.py OUT.json          # one process
    torchrun --standalone --nproc_per_node 2 tests/data_parallel_worker.py OUT.json

Every process builds the same seeded target and drafter; the main process writes the gathered answers to OUT.json.
"""

from __future__ import annotations

import json
import sys

from hf_dflash.parallel import distributed_state, generate_data_parallel
from tests.conftest import random_prompt, tiny_drafter, tiny_target

# Prompts of different lengths, more than one batch per process, and a count that does not split evenly.
PROMPTS = [random_prompt(n, seed=n)[0].tolist() for n in (7, 2, 11, 4, 9, 3, 6)]


def main(out_path: str) -> None:
    state = distributed_state()
    target = tiny_target("llama", seed=21).to(state.device)
    drafter = tiny_drafter(target, block_size=4).to(state.device)
    answers = generate_data_parallel(target, drafter, PROMPTS, batch_size=2, max_new_tokens=10, do_sample=False,
                                     pad_token_id=0)
    if state.is_main_process:
        with open(out_path, "w") as f:
            json.dump({"num_processes": state.num_processes, "answers": answers}, f)
    # Leave the gloo group before exiting: torn down at interpreter exit instead, its threads once aborted a process
    # ("terminate called without an active exception") after it had decoded all of its prompts.
    state.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
