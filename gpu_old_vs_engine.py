"""One-off (branch engine-generate): generate's fast path, main's static step against the engine, on the same random
SmolLM2-shaped target (bf16, CUDA), ms per step after the prefill. Before a device call, put main's modeling beside
this file: `rm -rf old && mkdir old && git archive main modeling | tar -x -C old/`. Then, on the device:
    source benchmarks/gpu/device_env.sh; python3 gpu_old_vs_engine.py engine
    mv modeling modeling_engine && cp -r old/modeling modeling && python3 gpu_old_vs_engine.py static
    rm -rf modeling && mv modeling_engine modeling
"""
import json, os, sys, time
import torch
from transformers import AutoConfig, AutoModelForCausalLM
import hf_dflash
from hf_dflash.generate_cli import DEFAULT_DRAFTER
label = sys.argv[1]
torch.manual_seed(0)
config = AutoConfig.for_model("llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
    rope_theta=100000.0, tie_word_embeddings=True, head_dim=64)
target = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().eval()
drafter = hf_dflash.DFlashDraftModel.from_pretrained(DEFAULT_DRAFTER, dtype=torch.bfloat16).cuda().eval()
results = []
for batch in (1, 16):
    ids = torch.randint(100, 40000, (batch, 64), device="cuda")
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=128, min_new_tokens=128, do_sample=False, pad_token_id=0)
    for _ in range(2):
        target.generate(ids, assistant_model=drafter, dflash_fast_path=True, **kw)
    first = dict(kw, max_new_tokens=1, min_new_tokens=1)
    for _ in range(3):
        target.generate(ids, assistant_model=drafter, dflash_fast_path=True, **first)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(5):
        target.generate(ids, assistant_model=drafter, dflash_fast_path=True, **first)
    torch.cuda.synchronize(); prefill = (time.perf_counter() - t) / 5
    print(label, batch, f"prefill + first token {prefill*1000:.1f} ms", flush=True)
    for mode in ("dflash", "dflash"):
        torch.cuda.synchronize(); t = time.perf_counter()
        if mode == "dflash":
            out = target.generate(ids, assistant_model=drafter, dflash_fast_path=True, return_dict_in_generate=True, **kw)
            steps = sum(len(x) for x in out.acceptance_lengths) / batch
        else:
            out = target.generate(ids, **kw); steps = 128
        torch.cuda.synchronize(); dt = time.perf_counter() - t
        per_step = 1000 * (dt - prefill) / steps
        results.append(dict(label=label, batch=batch, mode=mode, seconds=dt, prefill_s=prefill, steps=steps, ms_per_step=per_step))
        print(label, batch, mode, f"{dt*1000:.0f} ms, {steps:.0f} steps, {per_step:.2f} ms/step after the prefill", flush=True)
with open(os.path.join(os.environ.get("OUT", "/tmp"), f"old_vs_engine_{label}.json"), "w") as f:
    json.dump(results, f, indent=1)
