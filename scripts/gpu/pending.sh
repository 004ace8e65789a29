#!/usr/bin/env bash
# The H200 measurements the CPU-only sessions of 2026-12-04 could not make, in device-call-sized
# parts (each under the device tool's 10-minute limit). Build the bundle here first
# (ENGINE_ONLY=1 bash scripts/gpu/bundle.sh: 26 MB, carry [".gpu-bundle"]), then on the device:
#
#   OUT=$OUT bash scripts/gpu/pending.sh 1   # GPU tests of the new code (batch-invariant mode,
#                                            # the MTP graphs, e4m3 MLA dots) + the MLA kernel sweep
#   OUT=$OUT bash scripts/gpu/pending.sh 2   # bench engine v2-lite bf16 (20x target) + batch-invariant cost
#   OUT=$OUT bash scripts/gpu/pending.sh 3   # bench spec (MTP passes in graphs) + v3-slice + FP4 probe
#
# Results land in $OUT; copy them to bench/results/ under the names docs/benchmarks.md uses.
set -uo pipefail
source .gpu-bundle/activate
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:?set OUT to a result folder}
part=${1:?which part: 1, 2 or 3}
bench_engine() { timeout "$1" python3 -m deepserve.cli bench engine "${@:2}" 2>&1 | tail -30; }
case "$part" in
  1)
    timeout 400 python3 -m pytest -q -s tests/gpu/test_batch_invariant_gpu.py \
      tests/gpu/test_engine_gpu.py tests/gpu/test_kernel_mla_decode_gpu.py \
      tests/gpu/test_speculative_gpu.py 2>&1 | tail -40 | tee "$OUT/gpu-tests.txt"
    OUT=$OUT timeout 170 python3 scripts/gpu/bench_mla_decode.py 2>&1 | tail -24 | tee "$OUT/mla.txt"
    ;;
  2)
    bench_engine 330 --preset v2-lite --device cuda --decode-steps 32 --prefill-tokens 4096,16384 \
      --decode-batches 1,16,64,256 --transformers-batches 64 --transformers-steps 8 \
      --json "$OUT/engine-cuda-h200.json" | tee "$OUT/engine.txt"
    bench_engine 240 --preset v2-lite --device cuda --batch-invariant --no-transformers \
      --prefill-tokens 4096,16384 --decode-batches 1,64,256 \
      --json "$OUT/engine-v2-lite-batch-invariant-cuda-h200.json" | tee "$OUT/invariant.txt"
    ;;
  3)
    # Batch 256 too: its 1,024 verification rows now have a graph (the ladder past 512).
    timeout 330 python3 -c 'import argparse,sys; from deepserve.bench import spec; \
      p=argparse.ArgumentParser(); spec.add_arguments(p); sys.exit(spec.main(p.parse_args(sys.argv[1:])))' \
      --preset v2-lite --device cuda --batches 1,16,64,256 --acceptance 0.8 --speculative-tokens 3 \
      --prompt-tokens 256 --max-tokens 48 --json "$OUT/spec-cuda-h200.json" 2>&1 | tail -30 \
      | tee "$OUT/spec.txt"
    bench_engine 180 --preset v3-slice --device cuda --decode-steps 16 --no-transformers \
      --prefill-tokens 16384 --decode-batches 256 --json "$OUT/engine-v3-slice-cuda-h200.json" \
      | tee "$OUT/v3.txt"
    # Issue 17's FP4 question: the e2m1 decode measured apart (bf16 / fp4 / fp4 undecoded / fp8).
    OUT=$OUT timeout 60 python3 scripts/gpu/fp4_evidence.py 2>&1 | tail -8 | tee "$OUT/fp4.txt"
    ;;
  *) echo "part must be 1, 2 or 3" >&2; exit 2 ;;
esac
