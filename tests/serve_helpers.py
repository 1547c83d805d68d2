"""What the serving tests share: a tiny served model, a server process that can be made to fail on cue, and the
plain greedy answers the served ones must equal.

The served model is stories260K saved as a transformers checkpoint, with a chat template (its GGUF has none) and a
generation config that samples (transformers serve's continuous batching applies a request's temperature, top-k
and top-p only where the model's own config has those processors; a greedy request is sent as top-k 1). Its
drafter is a seeded random DFlash drafter whose own context is shorter than the target's, so that the drafter's
limit is the one a request meets.

The server runs `hf-dflash serve`'s own code (`tests/serve_launcher.py`: the real parser, checks and
`serve_until_stopped`) with a `FaultyServedTarget`, which adds two things to the loaded target's input embedding: a
short sleep per call (`STEP_DELAY`: a request's steps take a known least time, so that a test can tell a cancelled
request from one that ended by itself), and an exception whenever the POISON token is embedded (the prompt of a
request that must fail inside its step).
"""

from __future__ import annotations

import inspect
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from hf_dflash.serve import ServedTarget

# The drafter's path through the server needs the DFlash continuous-batching engine: a manager that
# `init_continuous_batching(assistant_model=drafter)` returns. Its tests run once hf-dflash has it.
ENGINE_TAKES_DRAFTER = "assistant_model" in inspect.signature(LlamaForCausalLM.init_continuous_batching).parameters
WAITING_FOR_ENGINE = "waiting for the DFlash continuous-batching engine (init_continuous_batching takes no drafter yet)"

POISON = 510  # stories260K's "~": no story prompt or answer contains it
STEP_DELAY = 0.02  # seconds per embedding call in the served target
DRAFTER_CONTEXT = 1024  # the drafter's own context, below the target's 2048
# A paged cache of 16,384 tokens, which the tests never fill: transformers' default on a CPU holds over half a
# million, which 5.17 allocates at the first request and attends over at every step.
SERVER_CB_OPTIONS = ("--cb-block-size", "32", "--cb-num-blocks", "512", "--cb-max-batch-tokens", "2048")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class InjectedFault(RuntimeError):
    """Raised inside a request's step when its tokens hold the POISON token."""


@dataclass(frozen=True)
class FaultyServedTarget(ServedTarget):
    """A ServedTarget whose loaded target sleeps `step_delay` per embedding call and raises on `poison`."""

    poison: int = POISON
    step_delay: float = STEP_DELAY

    def prepare(self, target: torch.nn.Module) -> None:
        super().prepare(target)
        poison, delay = self.poison, self.step_delay

        def slow_and_poisoned(_module: torch.nn.Module, args: tuple) -> None:
            time.sleep(delay)
            if bool((args[0] == poison).any()):
                raise InjectedFault(f"injected fault: token {poison} in a request's step")

        target.get_input_embeddings().register_forward_pre_hook(slow_and_poisoned)


def save_served_model(root: Path) -> tuple[Path, Path]:
    """stories260K as the server loads it, and its random drafter: (target folder, drafter folder)."""
    from hf_dflash import DFlashConfig, DFlashDraftModel
    from hf_dflash.bundled_models import load_stories260k

    model, tokenizer = load_stories260k()
    tokenizer.chat_template = CHAT_TEMPLATE
    config = model.generation_config
    # Not 1.0: transformers' own manager applies a request's temperature and top-p only where the model's config
    # has those processors, and a temperature or top-p of 1 makes none.
    config.do_sample, config.temperature, config.top_k, config.top_p = True, 0.9, 50, 0.95
    target_folder, drafter_folder = root / "stories260k-chat", root / "drafter"
    model.save_pretrained(target_folder)
    tokenizer.save_pretrained(target_folder)
    torch.manual_seed(0)
    drafter_config = DFlashConfig.for_target(
        model.config, num_hidden_layers=1, block_size=4, mask_token_id=0, max_position_embeddings=DRAFTER_CONTEXT
    )
    DFlashDraftModel(drafter_config).save_pretrained(drafter_folder)
    return target_folder, drafter_folder


def launcher_command(target: Path, drafter: Path, port: int, with_drafter: bool, grace_seconds: float) -> list[str]:
    """The command that runs the test server: `hf-dflash serve`'s arguments, run by tests/serve_launcher.py."""
    command = [sys.executable, str(Path(__file__).with_name("serve_launcher.py")), "serve", str(target),
               "--drafter", str(drafter), "--port", str(port), "--graceful-shutdown-seconds", str(grace_seconds),
               "--log-level", "warning", *SERVER_CB_OPTIONS]
    return command + ([] if with_drafter else ["--no-drafter-for-tests"])


@torch.no_grad()
def greedy_answer(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int) -> list[int]:
    """Plain greedy `generate` on `prompt_ids`: the new tokens, up to and without the first eos."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=eos_token_id, pad_token_id=eos_token_id)
    new = out[0, len(prompt_ids):].tolist()
    return new[: new.index(eos_token_id)] if eos_token_id in new else new
