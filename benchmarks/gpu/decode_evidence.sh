#!/usr/bin/env bash
# The decoding figures of benchmarks/step-cost.md, batches-and-serving.md and sampling.md on a lent GPU machine, one
# part per call, the calls chained within 30 s of each other (README.md beside this file). Each part writes its JSON
# (and plot) into $OUT. Stage first, here: `bash benchmarks/gpu/stage_smollm2.sh` and
# `bash benchmarks/gpu/stage_prompts.sh`. From the repository root:
#   call 1, carry .stage/a .whl:           bash benchmarks/gpu/decode_evidence.sh qwen3-sampled
#       the top-k + top-p step's cost (eager and graph-replayed), then Qwen3-8B's shape (random weights) at 512,
#       2,048 and 8,192 tokens of context with Qwen3's sampling defaults, against compiled plain generate
#   call 2, carry .stage/b:                bash benchmarks/gpu/decode_evidence.sh qwen3-greedy
#   call 3, carry .stage/c .stage/prompts: bash benchmarks/gpu/decode_evidence.sh smollm2-sampled
#       SmolLM2-135M-Instruct + the shipped drafter, 32 held-out chat prompts, batch 1 / 4 / 16, Llama-3's sampling
#   call 4:                                bash benchmarks/gpu/decode_evidence.sh smollm2-greedy
#   call 5:                                bash benchmarks/gpu/decode_evidence.sh own-lengths
#       compiled plain generate on the prompts at their own lengths (a compile per shape), then the two samplers'
#       cost on the GPU (`hf-dflash bench sampler-cost`)
#   call 6:                                bash benchmarks/gpu/decode_evidence.sh checks
#       the fast path's correctness on the GPU (tests/test_fast_path_gpu.py: graph-replayed tokens equal plain
#       greedy; grouped_mm MoE experts, qwen3_next's included, record in a graph)
# Files left on the machine by an earlier call (the GGUF's parts, the prompts) stay while the machine is held.
set -u
source benchmarks/gpu/device_env.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
bench=(python3 -m hf_dflash.cli bench)
qwen3=("${bench[@]}" decode --random-weights qwen3-8b --context-lengths 512 2048 8192 --max-new-tokens 64
       --methods plain-static dflash)
smollm2=("${bench[@]}" decode --target smollm2 --prompts .stage/prompts/heldout32.jsonl.gz --limit 32
         --max-new-tokens 256)
needs_smollm2() {
    if [ -z "${HF_DFLASH_SMOLLM2_GGUF:-}" ]; then echo "no SmolLM2 GGUF on this machine yet: carry .stage/a, b, c"; exit 1; fi
    if [ ! -f .stage/prompts/heldout32.jsonl.gz ]; then echo "no held-out prompts: carry .stage/prompts"; exit 1; fi
}
case "${1:?qwen3-sampled, qwen3-greedy, smollm2-sampled, smollm2-greedy, own-lengths or checks}" in
qwen3-sampled)
    timeout 100 "${bench[@]}" top-k-top-p --device cuda --out "$OUT/top_k_top_p_cuda.json"
    timeout 450 "${qwen3[@]}" --sampling qwen3 --out "$OUT/qwen3_8b_b1_qwen3_sampling.json" 2>&1 | tail -n 12
    ;;
qwen3-greedy)
    timeout 540 "${qwen3[@]}" --sampling greedy --out "$OUT/qwen3_8b_b1_greedy.json" 2>&1 | tail -n 12
    ;;
smollm2-sampled | smollm2-greedy)
    needs_smollm2
    sampling=$([ "$1" = smollm2-sampled ] && echo llama3 || echo greedy)
    timeout 540 "${smollm2[@]}" --batch-sizes 1 4 16 --methods plain-static dflash --sampling "$sampling" \
        --out "$OUT/smollm2_heldout32_batches_$sampling.json" 2>&1 | tail -n 12
    ;;
own-lengths)
    needs_smollm2
    timeout 300 "${smollm2[@]}" --limit 16 --batch-sizes 1 --own-lengths --methods plain-static dflash \
        --out "$OUT/smollm2_heldout16_own_lengths.json" 2>&1 | tail -n 6
    timeout 270 "${bench[@]}" sampler-cost --prompts .stage/prompts/heldout32.jsonl.gz --limit 8 \
        --out "$OUT/sampler_cost_smollm2_cuda.json"
    ;;
checks)
    timeout 500 python3 -m pytest -q -p no:cacheprovider tests/test_fast_path_gpu.py 2>&1 \
        | tee "$OUT/fast_path_gpu.txt" | tail -n 40
    ;;
esac
