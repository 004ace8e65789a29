#!/usr/bin/env bash
# The GPU measurements of issues 17 and 19 (owed after the run of 2026-12-05; parts 1-7 all ran
# on an H100 on 2026-12-06), in device-call-sized parts (each under the device tool's 10-minute
# limit). Build the bundle here first
# (ENGINE_ONLY=1 bash scripts/gpu/bundle.sh, carry [".gpu-bundle"]), then on the device:
#
#   OUT=$OUT bash scripts/gpu/pending.sh 1   # issue 19: bench spec at batch 256 (both levels);
#                                            # if it fails, diag_spec.py replay by replay
#   OUT=$OUT bash scripts/gpu/pending.sh 2   # issue 19: bench spec at batch 1/16/64, both levels
#   OUT=$OUT bash scripts/gpu/pending.sh 3   # GPU tests changed since, the MLA kernel (128 heads,
#                                            # e4m3 dots) at batch 64/256, v3-slice
#   OUT=$OUT bash scripts/gpu/pending.sh 4   # bench engine v2-lite bf16 (its JSON) + batch-invariant cost
#   OUT=$OUT bash scripts/gpu/pending.sh 5   # issue 19: a speculative step's phases; the relaxed invariant test
#   OUT=$OUT bash scripts/gpu/pending.sh 6   # issue 17: bf16 / FP8 weights / FP8 weights + KV side by side
#   OUT=$OUT bash scripts/gpu/pending.sh 7   # issue 19: confident test head, verification priced by measured graphs
#
# Every step's output lands in $OUT (a log per step); copy results to bench/results/ under the
# names docs/benchmarks.md uses.
set -uo pipefail
source .gpu-bundle/activate
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:?set OUT to a result folder}
part=${1:?which part: 1 to 7}
# Result names carry the card that made them (cuda-h200 or cuda-h100: a device call may get either).
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o 'H[0-9]00' | tr A-Z a-z)
m=cuda-${gpu:-gpu}
echo "device: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) -> $m"
bench_engine() { timeout "$1" python3 -m deepserve.cli bench engine "${@:2}" 2>&1 | tail -30; }
bench_spec() {
  timeout "$1" python3 -c 'import argparse,sys; from deepserve.bench import spec; \
    p=argparse.ArgumentParser(); spec.add_arguments(p); sys.exit(spec.main(p.parse_args(sys.argv[1:])))' \
    --preset v2-lite --device cuda --speculative-tokens 3 --prompt-tokens 256 --max-tokens 48 \
    "${@:2}" 2>&1 | tail -30
}
diag() {  # diag <seconds> <log name> [ENV=VALUE...]: batch 256, every graph replay checked
  env "${@:3}" timeout "$1" python3 scripts/gpu/diag_spec.py --preset v2-lite --device cuda \
    --batches 256 --acceptance 0.8 --speculative-tokens 3 --prompt-tokens 256 --max-tokens 8 \
    2>&1 | grep -v "^\s*$" | tail -25 | tee "$OUT/$2.txt"
}
case "$part" in
  1)
    bench_spec 330 --batches 256 --acceptance 0.8,0.5 --json "$OUT/spec-b256-$m.json" \
      | tee "$OUT/spec-b256.txt"
    if [ ! -s "$OUT/spec-b256-$m.json" ]; then
      diag 70 diag-b256
      diag 60 diag-b256-ladder512 DIAG_LADDER_MAX=512
      diag 60 diag-b256-no-mtp-graphs DIAG_NO_MTP_GRAPHS=1
    fi
    ;;
  2)
    bench_spec 520 --batches 1,16,64 --acceptance 0.8,0.5 --json "$OUT/spec-$m.json" \
      | tee "$OUT/spec.txt"
    ;;
  3)
    timeout 240 python3 -m pytest -q -s tests/gpu/test_batch_invariant_gpu.py \
      tests/gpu/test_speculative_gpu.py tests/gpu/test_engine_gpu.py \
      tests/gpu/test_graph_staging_gpu.py 2>&1 | tail -30 \
      | tee "$OUT/gpu-tests.txt"
    # 16 and 128 heads at batch 64 / 256: the 128-head target and the e4m3-dots variant's timing
    MLA_BATCHES=64,256 OUT=$OUT timeout 140 python3 scripts/gpu/bench_mla_decode.py \
      2>&1 | tail -16 | tee "$OUT/mla.txt"
    bench_engine 160 --preset v3-slice --device cuda --decode-steps 16 --no-transformers \
      --prefill-tokens 16384 --decode-batches 256 --json "$OUT/engine-v3-slice-$m.json" \
      | tee "$OUT/v3.txt"
    ;;
  4)
    bench_engine 330 --preset v2-lite --device cuda --decode-steps 32 --prefill-tokens 4096,16384 \
      --decode-batches 1,16,64,256 --transformers-batches 64 --transformers-steps 8 \
      --json "$OUT/engine-$m.json" | tee "$OUT/engine.txt"
    bench_engine 240 --preset v2-lite --device cuda --batch-invariant --no-transformers \
      --prefill-tokens 4096,16384 --decode-batches 1,64,256 \
      --json "$OUT/engine-v2-lite-batch-invariant-$m.json" | tee "$OUT/invariant.txt"
    ;;
  5)
    # Where a speculative step's time goes (phases synchronized; issue 19's batch-256 loss), and
    # the invariant-vs-default GPU test as relaxed in 0a68797.
    timeout 150 python3 scripts/gpu/spec_phases.py --preset v2-lite --device cuda \
      --batches 1,16,64,256 --acceptance 0.8 --speculative-tokens 3 --prompt-tokens 256 \
      --max-tokens 48 2>&1 | grep -v "^\s*$" | tail -12 | tee "$OUT/phases.txt"
    timeout 150 python3 -m pytest -q -s tests/gpu/test_batch_invariant_gpu.py 2>&1 | tail -8 \
      | tee "$OUT/gpu-invariant.txt"
    ;;
  6)
    # Issue 17 item 2 at the current code: bf16 and FP8 weights (and FP8 KV) side by side.
    b() { bench_engine 130 --preset v2-lite --device cuda --prefill-tokens 16384 \
      --decode-batches 64,256 --no-transformers "$@"; }
    b --weights bf16 --no-quality --json "$OUT/engine-v2-lite-bf16-$m.json" | tee "$OUT/bf16.txt"
    b --weights fp8 --json "$OUT/engine-v2-lite-fp8w-$m.json" | tee "$OUT/fp8w.txt"
    b --weights fp8 --kv-cache-dtype fp8 --no-quality --json "$OUT/engine-v2-lite-fp8w-fp8kv-$m.json" \
      | tee "$OUT/fp8w-fp8kv.txt"
    ;;
  7)
    # Issue 19 after the confident test head and verification priced by the decode graphs'
    # measured times: both levels, every batch; then the flat head at batch 64 and 256.
    bench_spec 220 --batches 1,16,64,256 --acceptance 0.8,0.5 --json "$OUT/spec-$m.json" \
      | tee "$OUT/spec.txt"
    bench_spec 60 --batches 64,256 --acceptance 0.5 --head flat \
      --json "$OUT/spec-flat-head-$m.json" | tee "$OUT/spec-flat.txt"
    ;;
  *) echo "part must be 1 to 7" >&2; exit 2 ;;
esac
