#!/usr/bin/env bash
# One GPU, one deployment mode, beside its own engine-only ceiling in the same call (issue 32):
#
#   OUT=/tmp/out MODE=aggregated bash scripts/gpu/serve_modes.sh agent:32 chat:128 agent:256
#   OUT=/tmp/out MODE=disaggregated WEIGHTS=fp8 bash scripts/gpu/serve_modes.sh agent:32 chat:128
#
# First `deepserve bench engine` on this card and weights (prefill at 16K tokens a step, decode
# at batch 128 and 256: the ceilings `bench serve --engine-json` divides by), then
# scripts/gpu/serve.sh with `deepserve up --device cuda --mode MODE` (disaggregated on one GPU:
# the two engines under the stack's own MPS daemon, when the machine has one). Results:
# $OUT/engine-v2-lite-WEIGHTS-CARD.json and $OUT/serve-TRACE-N-MODE-CARD.json (CARD: cuda-h100
# or cuda-h200 from nvidia-smi), the logs and plots in $OUT/extra.tgz.
# Env: MODE (aggregated), WEIGHTS (bf16), MODEL (v2-lite), ENGINE_TIMEOUT (240 s), ENGINE_JSON
# (a ceiling from an earlier call on the same kind of card: skips bench engine; say so).
set -euo pipefail
OUT=${OUT:?set OUT to a result folder}
MODE=${MODE:-aggregated}
WEIGHTS=${WEIGHTS:-bf16}
MODEL=${MODEL:-v2-lite}
source .gpu-bundle/activate
if nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -q H200; then
  card=cuda-h200
else
  card=cuda-h100
fi
engine="$OUT/engine-$MODEL-$WEIGHTS-$card.json"
if [ -n "${ENGINE_JSON:-}" ]; then  # a ceiling measured in an earlier call on this kind of card
  engine=$ENGINE_JSON
  echo "engine ceiling from $engine: $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["device_name"])' "$engine")"
else
  t0=$(date +%s)
  timeout "${ENGINE_TIMEOUT:-240}" python3 -m deepserve.cli bench engine --preset "$MODEL" \
    --device cuda --weights "$WEIGHTS" --prefill-tokens 16384 --decode-batches 128,256 \
    --decode-steps 16 --no-transformers --no-quality --json "$engine" 2>&1 | tail -12
  echo "bench engine took $(( $(date +%s) - t0 )) s"
fi
export DEEPSERVE_WEIGHTS=$WEIGHTS  # every engine of the stack (the flag's environment twin)
status=0
ENGINE_JSON=$engine MODEL=$MODEL UP_ARGS="--mode $MODE ${UP_ARGS:-}" \
  bash scripts/gpu/serve.sh "$@" || status=$?
for f in "$OUT"/serve-*.json; do
  [ -e "$f" ] || continue
  case $f in *-cuda-h[0-9]*.json) continue ;; esac
  mv "$f" "${f%.json}-$MODE-$card.json"
done
exit $status
