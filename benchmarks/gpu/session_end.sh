#!/usr/bin/env bash
# The last call of a training session on the GPU machine: HumanEval tau of the new drafter and of the shipped one
# (bf16, the first 16 prompts, 256 new tokens, greedy, batch 1: `hf-dflash bench decode`), bf16 closeness to eager
# plain greedy (`hf-dflash bench closeness`: the first 8 of the 32 held-out prompts of stage_prompts.sh, 128 new
# tokens), and the drafter and curves copied into $OUT. From the repository root:
#   bash benchmarks/gpu/session_end.sh
set -u
source benchmarks/gpu/device_env.sh
RUN=${RUN:-$HOME/run}
if kill -0 "$(cat "$RUN/pid" 2>/dev/null)" 2>/dev/null; then echo "WARNING: the training job is still running"; fi
new=$(cat "$RUN/current")
shipped=hf_dflash/drafters/smollm2-135m-instruct
mkdir -p "$RUN/eval"
bench=(python3 -m hf_dflash.cli bench decode --target smollm2 --prompts .stage/prompts/humaneval.jsonl.gz --limit 16
       --batch-sizes 1 --max-new-tokens 256)
"${bench[@]}" --drafter "$new" --methods plain-static dflash --out "$RUN/eval/humaneval_new.json" 2>&1 | tail -n 4
"${bench[@]}" --drafter "$shipped" --methods dflash --out "$RUN/eval/humaneval_shipped.json" 2>&1 | tail -n 3
python3 -m hf_dflash.cli bench closeness --drafter "$new" --prompts .stage/prompts/heldout32.jsonl.gz \
    --out "$RUN/eval/closeness.json" 2>&1 | tail -n 2
tar -czf "$OUT/eval.tar.gz" -C "$RUN" eval
bash benchmarks/gpu/poll.sh 0
