#!/usr/bin/env bash
# The first calls of a training session on the device, each carrying one part of the SmolLM2 GGUF
# (`PARTS=4 bash benchmarks/gpu/stage_smollm2.sh`: the prompt sets do not fit beside a third of it), within 30 s of
# each other:
#   call 1, carry .stage/a .whl:           bash benchmarks/gpu/session_start.sh throughput
#       environment, then training throughput before/after at the real shape (random weights, no GGUF needed), in
#       the foreground, alone on the GPU; the report goes to $OUT and stays on the machine;
#   calls 2, 3, carry .stage/b, .stage/c:  bash benchmarks/gpu/session_start.sh stage
#   call 4, carry .stage/d .stage/prompts: bash benchmarks/gpu/session_start.sh train SECONDS
#       SmolLM2 assembled and checked, then train_session.sh detached, sized from the throughput report to stop
#       SECONDS from now. Poll it with poll.sh; end with session_end.sh.
set -u
source benchmarks/gpu/device_env.sh
report=~/training_throughput_h200.json
case "${1:?throughput, stage or train SECONDS}" in
throughput)
    nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
    timeout 400 python3 -m hf_dflash.cli bench training-throughput --steps 5 --warmup 3 --out "$report"
    cp "$report" "$OUT/"
    ;;
stage)
    ls -l ~/stage
    ;;
train)
    deadline=$(( $(date +%s) + ${2:?seconds from now by which training must stop} ))
    if [ -z "${HF_DFLASH_SMOLLM2_GGUF:-}" ]; then echo "no SmolLM2 GGUF on this machine: carry .stage/a, b, c, d"; exit 1; fi
    # no throughput call this session: an earlier session's report, carried with the prompts, sizes the run
    if [ ! -f "$report" ] && [ -f .stage/prompts/training_throughput_h200.json ]; then
        cp .stage/prompts/training_throughput_h200.json "$report"
    fi
    # A step's time for the long run: the slower of the two A/B arms' settings (hard labels or distillation, batch
    # 64, grouped, compiled loss), plus 15% for real data; without the compiled loss when it failed here.
    read -r ms compile <<<"$(python3 - "$report" <<'PY'
import json, sys
try:
    rows = {r["setting"]: r for r in json.load(open(sys.argv[1]))["training"]}
except (OSError, ValueError):
    rows = {}
arms = [rows.get(n, {}) for n in ("sparse compiled, batch 64, grouped", "compiled + distill top-32, b 64, grouped")]
if all("ms_per_step" in r for r in arms):
    print(round(1.15 * max(r["ms_per_step"] for r in arms)), "auto")
else:
    print(400, "off")
PY
)"
    # A step time measured on real data in an earlier session (MS_PER_STEP=...) overrides the estimate, and
    # COMPILE_LOSS=auto/off the choice (a machine with no report here, and no throughput call, would otherwise
    # train with the loss uncompiled).
    ms=${MS_PER_STEP:-$ms}
    compile=${COMPILE_LOSS:-$compile}
    echo "long run sized at $ms ms per step, compiled loss: $compile"
    DEADLINE=$deadline MS_PER_STEP=$ms EXTRA="--compile-loss $compile" \
        setsid nohup bash benchmarks/gpu/train_session.sh > ~/session.log 2>&1 < /dev/null &
    sleep 30
    tr '\r' '\n' < ~/session.log | grep -v '^\s*$' | tail -n 5
    ;;
esac
