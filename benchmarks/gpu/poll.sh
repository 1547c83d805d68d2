#!/usr/bin/env bash
# Poll train_session.sh on the device: wait SECONDS (a call must end within 10 minutes), print the log's tail, and
# copy the current drafter (config, training_args.json, weight shards) and every run's curve into $OUT, so that
# nothing is lost if the machine goes back early. From the repository root:  bash benchmarks/gpu/poll.sh 500
# COPY=regen bash benchmarks/gpu/poll.sh 0 instead copies the answers regenerated this session (gzip, in parts of
# 15 MB) into $OUT, for the next session to carry in .stage/regen/ beside the earlier ones (train_session.sh then
# answers none of those sets again); the answers it took from .stage/regen ($RUN/reused) stay out.
RUN=${RUN:-$HOME/run}
LOG=${LOG:-$HOME/session.log}
end=$(( $(date +%s) + ${1:-0} ))
running() { kill -0 "$(cat "$RUN/pid" 2>/dev/null)" 2>/dev/null; }
while [ "$(date +%s)" -lt "$end" ] && running; do sleep 5; done
tr '\r' '\n' < "$LOG" | grep -v '^\s*$' | tail -n 8
if [ "${COPY:-}" = regen ]; then
    for file in "$RUN"/regenerated*.safetensors; do
        name=$(basename "$file" .safetensors)
        if [ -f "$file" ] && ! grep -qx "$name" "$RUN/reused" 2>/dev/null; then
            gzip -c "$file" | split -b 15M -d - "$OUT/$name.part"
        fi
    done
    ls -l "$OUT"
    parts=$(ls "$OUT" | wc -l)
    if [ "$parts" -gt 8 ]; then echo "$parts parts in $OUT: a call brings back at most 8 files"; fi
    exit 0
fi
current=$(cat "$RUN/current" 2>/dev/null)
if [ -n "$current" ] && [ -f "$current/config.json" ]; then
    mkdir -p "$OUT/drafter"
    cp "$current"/config.json "$current"/training_args.json "$current"/*.safetensors "$OUT/drafter/" 2>/dev/null
    cp "$current"/model.safetensors.index.json "$OUT/drafter/" 2>/dev/null
    echo "copied $(basename "$current") at step $(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['steps'])" "$current/training_args.json")"
fi
# Curves and the whole log in one file (at most 8 files come back per call).
tr '\r' '\n' < "$LOG" | grep -v 'it/s\]$' > "$RUN/session_log.txt"
tar -czf "$OUT/curves.tar.gz" -C "$RUN" session_log.txt $(cd "$RUN" && ls -d */train_log.jsonl */training_args.json 2>/dev/null)
if [ -f "$RUN/done" ]; then echo "training done"; elif ! running; then echo "training job NOT running"; fi
