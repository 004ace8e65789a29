#!/usr/bin/env bash
# The whole stack on a GPU machine, driven over HTTP: what docs/benchmarks.md's GPU figures
# come from. Run from the checkout with the bundle carried (scripts/gpu/bundle.sh):
#
#   OUT=/tmp/out bash scripts/gpu/serve.sh agent:32 agent:128 chat:128
#
# Each TRACE:SESSIONS[:CLIENTS] argument is one `deepserve bench serve --url` run at that
# concurrency (CLIENTS: its --client-processes; default one per 32 sessions), the Nth with
# --seed N (its own prompts: a run never finds the ones of a run before it in the caches);
# results land in $OUT/serve-TRACE-SESSIONS.json; the plots, the services' logs, a /metrics
# snapshot of each service after each run and (PROFILE=1, with a bundle built by
# PROFILER=1 bash scripts/gpu/bundle.sh) py-spy dumps of every service PROFILE_AFTER seconds
# into each run (PROFILE=record: PROFILE_SECONDS (15) of samples of every engine's threads,
# idle ones included, as raw stacks for scripts/gpu/profile_summary.py) go into one
# $OUT/extra.tgz (the device tool brings back few files).
# Env: MODEL (v2-lite), PORT (8000), ENGINE_JSON (bench/results/engine-cuda-h200.json),
#      UP_ARGS (extra `deepserve up` flags), BENCH_ARGS (extra bench flags),
#      BENCH_TIMEOUT (seconds one bench run may take: 300).
set -euo pipefail
source .gpu-bundle/activate
OUT=${OUT:?set OUT to a result folder}
MODEL=${MODEL:-v2-lite}
PORT=${PORT:-8000}
ENGINE_JSON=${ENGINE_JSON:-bench/results/engine-cuda-h200.json}
RUN=/tmp/deepserve-run
mkdir -p "$OUT/logs" "$OUT/extra"
rm -rf "$RUN"

# shellcheck disable=SC2086
python3 -m deepserve.cli up --device cuda --model "$MODEL" --port "$PORT" --run-dir "$RUN" \
  ${UP_ARGS:-} > "$OUT/logs/up.log" 2>&1 &
up=$!
t0=$(date +%s)
until grep -q '^deepserve is up' "$OUT/logs/up.log"; do
  if ! kill -0 $up 2>/dev/null; then
    cp -r "$RUN/logs/." "$OUT/logs/" || true
    tar -C "$OUT" -czf "$OUT/extra.tgz" logs
    exit 1
  fi
  sleep 2
done
echo "stack up in $(( $(date +%s) - t0 )) s"
grep -E '^(deepserve: starting|  mode|  MPS|  [a-z]+-[0-9].*KV blocks)' "$OUT/logs/up.log" || true

snapshot() {  # /metrics of every service, from the supervisor's state file
  python3 - "$RUN/stack.json" "$1" <<'EOF'
import json, sys, urllib.request
state = json.load(open(sys.argv[1]))
for name, port in state["ops_ports"].items():
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    except OSError as exc:
        body = f"# unreachable: {exc}\n".encode()
    with open(f"{sys.argv[2]}-{name}.prom", "wb") as f:
        f.write(body)
EOF
}

profile() {  # py-spy dumps of every service's process, or recordings of the engines'
  local tag=$1
  sleep "${PROFILE_AFTER:-20}"
  python3 -c 'import json,sys; [print(k, v) for k, v in json.load(open(sys.argv[1]))["pids"].items()]' \
    "$RUN/stack.json" | {
    while read -r name pid; do
      case $name in nats|redis) continue ;; esac
      if [ "${PROFILE}" = record ]; then
        case $name in aggregated-*|prefill-*|decode-*) ;; *) continue ;; esac
        py-spy record --pid "$pid" -d "${PROFILE_SECONDS:-15}" -r 100 --threads --idle \
          --nonblocking -f raw -o "$OUT/extra/record-$tag-$name.txt" > /dev/null 2>&1 &
      else
        py-spy dump --pid "$pid" > "$OUT/extra/profile-$tag-$name.txt" 2>&1 || true
      fi
    done
    wait  # the recordings (children of this group, not of the script)
  }
}

status=0
seed=0  # each run its own prompts: a later run must not find an earlier one's in the cache
for spec in "$@"; do
  IFS=: read -r trace n clients <<< "$spec"  # TRACE:SESSIONS[:CLIENT_PROCESSES]
  tag="$trace-$n${clients:+-c$clients}"
  echo "== $tag"
  prof=""
  case ${PROFILE:-0} in 1|record) profile "$tag" & prof=$! ;; esac
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-300}" python3 -m deepserve.cli bench serve --url "http://127.0.0.1:$PORT/v1" \
    --model "deepseek-$MODEL" --trace "$trace" --sessions "$n" --concurrency "$n" --gpus 1 \
    --engine-json "$ENGINE_JSON" --json "$OUT/serve-$tag.json" --plot "$OUT/extra/serve-$tag.png" \
    --stack-json "$RUN/stack.json" ${clients:+--client-processes $clients} --seed "$seed" \
    ${BENCH_ARGS:-} || status=$?
  seed=$((seed + 1))
  if [ -n "$prof" ]; then wait "$prof" || true; fi  # not a bare wait: that waits for up too
  snapshot "$OUT/logs/metrics-$tag"
done

kill -TERM $up
wait $up || true
cp -r "$RUN/logs/." "$OUT/logs/" || true
mv "$OUT/logs" "$OUT/extra/"
tar -C "$OUT" -czf "$OUT/extra.tgz" extra && rm -rf "$OUT/extra"  # one file travels back
exit $status
