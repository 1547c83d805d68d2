#!/usr/bin/env bash
# Continuous batching on a lent GPU machine (docs/continuous-batching.md), one part per call, the calls chained
# within 30 s of each other (README.md beside this file). Stage first, here: `bash benchmarks/gpu/stage_smollm2.sh`
# and `bash benchmarks/gpu/stage_prompts.sh` (".stage/prompts" below: its files humaneval.jsonl.gz and
# heldout32.jsonl.gz, which fit a call beside a GGUF part; the whole folder does not). From the repository root:
#   call 1, carry .stage/a .whl:           bash benchmarks/gpu/continuous_evidence.sh checks
#       the engine on CUDA (tests/test_engine_gpu.py: schedules equal plain greedy) and the fast path's GPU tests
#   call 2, carry .stage/b:                bash benchmarks/gpu/continuous_evidence.sh env
#   call 3, carry .stage/c .stage/prompts: bash benchmarks/gpu/continuous_evidence.sh humaneval
#       SmolLM2-135M-Instruct + the shipped drafter, `hf-dflash bench continuous` at concurrency 1 / 4 / 16 / 64,
#       HumanEval prompts, all at once: transformers' manager with and without the drafter, and our fixed batches
#   call 4, carry .stage/prompts:          bash benchmarks/gpu/continuous_evidence.sh chat
#       the same on 32 held-out chat turns
#   call 4 or 5, carry .stage/prompts:     bash benchmarks/gpu/continuous_evidence.sh humaneval-cb-graphs
#       HumanEval again, both managers with CUDA graphs (transformers' own records none for SDPA by default)
#   the call after, carry .stage/prompts:  bash benchmarks/gpu/continuous_evidence.sh chat-cb-graphs
#       the same on 32 held-out chat turns
#   the GGUF's last call, carry its part and .stage/prompts: bash benchmarks/gpu/continuous_evidence.sh policy
#       (instead of humaneval) HumanEval, the drafter's manager with the verify policy (its steps in recorded parts)
#       beside the same manager at the full width and transformers' manager without a drafter; once the working
#       tree passed 34 MB a part and the tree no longer fitted one call: stage PARTS=4, then env for .stage/b and c
#   any call:                              bash benchmarks/gpu/continuous_evidence.sh graphs
#       the engine's GPU checks, then its step eager and graph-replayed, and what a new step shape costs, cold and
#       after the warmup recorded every row bucket (`hf-dflash bench engine-step`)
set -u
source benchmarks/gpu/device_env.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
continuous=(python3 -m hf_dflash.cli bench continuous --target smollm2 --requests 32 --max-new-tokens 64
            --concurrency 1 4 16 64 --max-seconds 60 --check 8)
needs_smollm2() {  # $1: the prompt set the part reads
    if [ -z "${HF_DFLASH_SMOLLM2_GGUF:-}" ]; then echo "no SmolLM2 GGUF here yet: carry .stage/a, b, c"; exit 1; fi
    if [ ! -f ".stage/prompts/$1.jsonl.gz" ]; then echo "no prompts: carry .stage/prompts"; exit 1; fi
}
case "${1:?checks, env, humaneval, humaneval-cb-graphs, chat-cb-graphs, chat, policy or graphs}" in
checks)
    timeout 500 python3 -m pytest -q -p no:cacheprovider tests/test_engine_gpu.py tests/test_fast_path_gpu.py 2>&1 \
        | tail -n 15
    ;;
env)
    ;;
graphs)
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_engine_gpu.py 2>&1 | tail -n 8
    timeout 150 python3 -m hf_dflash.cli bench engine-step --out "$OUT/engine_step_gpu.json" 2>&1 \
        | grep -E "requests|ahead"
    ;;
humaneval)
    needs_smollm2 humaneval
    timeout 560 "${continuous[@]}" --prompts .stage/prompts/humaneval.jsonl.gz \
        --out "$OUT/smollm2_continuous_humaneval_gpu.json" 2>&1 | tail -n 30
    ;;
humaneval-cb-graphs)
    needs_smollm2 humaneval
    timeout 540 "${continuous[@]}" --prompts .stage/prompts/humaneval.jsonl.gz --arms cb cb-drafter \
        --cb-cuda-graphs on --max-seconds 45 --check 4 --out "$OUT/smollm2_continuous_humaneval_cb_graphs_gpu.json" \
        2>&1 | tail -n 30
    ;;
chat-cb-graphs)
    needs_smollm2 heldout32
    timeout 540 "${continuous[@]}" --prompts .stage/prompts/heldout32.jsonl.gz --arms cb cb-drafter \
        --cb-cuda-graphs on --max-seconds 45 --check 4 --out "$OUT/smollm2_continuous_chat_cb_graphs_gpu.json" \
        2>&1 | tail -n 30
    ;;
chat)
    needs_smollm2 heldout32
    timeout 560 "${continuous[@]}" --prompts .stage/prompts/heldout32.jsonl.gz \
        --out "$OUT/smollm2_continuous_chat_gpu.json" 2>&1 | tail -n 30
    ;;
policy)
    needs_smollm2 humaneval
    timeout 560 "${continuous[@]}" --prompts .stage/prompts/humaneval.jsonl.gz --arms cb cb-drafter cb-drafter-full \
        --adaptive --max-seconds 40 --check 4 --out "$OUT/smollm2_continuous_humaneval_policy_gpu.json" 2>&1 \
        | tail -n 30
    ;;
*)
    echo "unknown part: $1 (checks, env, humaneval, humaneval-cb-graphs, chat-cb-graphs, chat, policy or graphs)"
    exit 2
    ;;
esac
