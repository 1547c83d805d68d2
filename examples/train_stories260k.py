"""Train a DFlash drafter for stories260K (a 5-layer TinyStories Llama) on CPU in about a minute, then measure tau.

    python examples/train_stories260k.py

The same through the CLI:  hf-dflash train --target stories260k --mask-token-id 0 --prompts prompts.jsonl ...
"""

import torch

from hf_dflash.bundled_models import load_stories260k
from hf_dflash.training import TrainingArguments, measure_tau, new_drafter, regenerate, train

target, tokenizer = load_stories260k()

# 1. The target writes its own training data (sampled, so 64 similar prompts give 128 different stories).
names = ["Lily", "Tom", "Sue", "Max", "Ben", "Anna", "Tim", "Mia"]
things = ["a ball", "a dog", "a cat", "a box", "a tree", "a car", "a hat", "a cake"]
prompts = [f"Once upon a time, {n} had {t}." for n in names for t in things] * 2
data = regenerate(target, tokenizer, prompts, max_new_tokens=64, do_sample=True, temperature=0.8)
data.save("stories260k-drafter/regenerated.safetensors")
print(f"regenerated {data.num_response_tokens} tokens at {data.tokens_per_second:.0f} tokens/s")

# 2. A fresh drafter: block of 8, mask rows use <unk> (id 0, a row stories never produce).
torch.manual_seed(0)
drafter = new_drafter(target, num_layers=2, block_size=8, mask_token_id=0)
held_out = ["One day, a little girl named Kim", "The bird sang", "Bob and Jane went to the park"]
print("tau before:", measure_tau(target, drafter, held_out, 64, tokenizer).mean_tau)

# 3. Train (writes stories260k-drafter/{config.json, model.safetensors, training_args.json, checkpoints/}).
train(target, drafter, data, TrainingArguments("stories260k-drafter", steps=600, batch_size=4, lr=3e-3, max_anchors=16))
print("tau after: ", measure_tau(target, drafter, held_out, 64, tokenizer).mean_tau)
