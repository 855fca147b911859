#!/usr/bin/env bash
# The GPU path, checked in one call (issue: a GPU is lent rarely and briefly, so everything that
# needs one runs from this one prepared script, within GPU_CHECK_BUDGET_S, default 480 s):
#
#   bash bench/gpu_check.sh                      # every step, results under $OUT (default ./gpu_check_out)
#   bash bench/gpu_check.sh --steps env,tests    # some steps, in the order given
#   bash bench/gpu_check.sh --dry-run            # on a CPU: each step's entry point starts (make test runs this)
#
# Steps:
#   env     the card, driver, torch/triton/transformers/cupy versions; the engine imports
#   tests   every `gpu`-marked test (pytest -m gpu; tests/gpu_path_checks.py --device cuda runs inside
#           tests/test_gpu_path.py: graph capture, replay vs eager, greedy tokens across graphs / eager
#           Triton / torch; tests/test_tp_one_rank.py: a one-rank NCCL TP group's collectives, and
#           greedy tokens with it equal to a runner without one)
#   parity  bench/gpu_parity.py: fp32 greedy token-identical to transformers on CUDA (graphs, eager
#           Triton, torch attention), bf16 teacher-forced against transformers bf16
#   bench   bench/gpu.py: decode vs the HBM floor vs transformers, prefill, throughput vs transformers'
#           generate_batch on W1x8, GPU idle between decode steps with overlap and graphs on/off
#   soak    bench/soak.py against `python -m server --device cuda`: an abort storm (half the requests
#           aborted) inside a short soak; counts, greedy re-runs, the KV memory identity, no 5xx
#
# Output under $OUT: gpu_check.log (everything), gpu_check.json (each step's status and seconds)
# and each step's own file (pytest_gpu.xml, parity.json, soak.json, soak_server.log,
# bench_gpu.json). Exit status: 0 when every step passed, 1 otherwise, 2 on bad flags.
# Knobs (environment): PYTHON, GPU_CHECK_BUDGET_S, GPU_CHECK_BENCH_MODELS (default smollm2-135m),
# GPU_CHECK_SOAK_REQUESTS (default 400), GPU_CHECK_PYTEST_ARGS (more pytest arguments, e.g. --deselect=...),
# GPU_CHECK_TEST_FILES (the test files, default: every file with a `gpu` mark).
set -uo pipefail

cd "$(dirname "$0")/.."
STEPS_ALL="env tests parity bench soak"
steps="$STEPS_ALL"
dry_run=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --steps) shift; steps="${1//,/ }" ;;
    --steps=*) steps="${1#--steps=}"; steps="${steps//,/ }" ;;
    -h|--help) sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
for s in $steps; do
  case " $STEPS_ALL " in *" $s "*) ;; *) echo "gpu_check.sh: unknown step $s (steps: $STEPS_ALL)" >&2; exit 2 ;; esac
done

if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
OUT="${OUT:-gpu_check_out}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
STATUS="$OUT/gpu_check.status"
: > "$LOG"; : > "$STATUS"
BUDGET="${GPU_CHECK_BUDGET_S:-480}"
START=$SECONDS
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

say() { echo "== $*" | tee -a "$LOG"; }

# run_step NAME CAP_S CMD...: the command under `timeout` (its cap, or what is left of the budget),
# its output into the log, its status into the status file.
run_step() {
  local name="$1" cap="$2"; shift 2
  local left=$((BUDGET - (SECONDS - START)))
  [ "$cap" -gt "$left" ] && cap=$left
  if [ "$cap" -lt 15 ]; then
    say "$name: skipped, ${left}s of the budget left"
    printf '%s\tskipped\t0\t0\n' "$name" >> "$STATUS"
    return
  fi
  say "$name (up to ${cap}s): $*"
  local t0=$SECONDS
  timeout -k 10 -s INT "$cap" "$@" >> "$LOG" 2>&1
  local rc=$? status=ok
  [ $rc -ne 0 ] && status=failed
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && status=timeout
  say "$name: $status (rc $rc, $((SECONDS - t0))s)"
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$((SECONDS - t0))" >> "$STATUS"
}

# pytest without the plugins no gpu test uses (hypothesis, schemathesis, anyio, langsmith): importing
# them costs seconds of every pytest start on a small machine. The dry run collects with the same set.
PYTEST_LEAN="-p no:cacheprovider -p no:hypothesispytest -p no:schemathesis -p no:anyio -p no:langsmith_plugin"
gpu_test_files() { echo "${GPU_CHECK_TEST_FILES:-$(grep -l "mark.gpu" tests/test_*.py | tr '\n' ' ')}"; }

if [ $dry_run -eq 1 ]; then
  # On a CPU: every step's entry point imports and parses its arguments; the tests are collected.
  for s in $steps; do
    case "$s" in
      env) run_step env 120 "$PY" -m bench.gpu_env ;;
      tests) run_step tests 120 "$PY" -m pytest -q --collect-only -m gpu $PYTEST_LEAN $(gpu_test_files) ;;
      parity) run_step parity 60 "$PY" -m bench.gpu_parity --help ;;
      soak) run_step soak 60 "$PY" -m bench.soak --help ;;
      bench) run_step bench 60 "$PY" -m bench.gpu --help ;;
    esac
  done
else
  for s in $steps; do
    case "$s" in
      env) run_step env 60 "$PY" -m bench.gpu_env ;;
      tests)
        # shellcheck disable=SC2046,SC2086
        run_step tests 240 "$PY" -m pytest -q -m gpu $PYTEST_LEAN -o addopts="-ra" \
          --junitxml="$OUT/pytest_gpu.xml" ${GPU_CHECK_PYTEST_ARGS:-} $(gpu_test_files) ;;
      parity) run_step parity 150 "$PY" -m bench.gpu_parity --device cuda --json "$OUT/parity.json" ;;
      soak)
        run_step soak 180 "$PY" -m bench.soak --launch --server-arg=--device=cuda \
          --num-requests "${GPU_CHECK_SOAK_REQUESTS:-400}" --concurrency 48 --abort-fraction 0.5 \
          --greedy-sample 10 --report "$OUT/soak.json" --server-log "$OUT/soak_server.log" ;;
      bench)
        # shellcheck disable=SC2086
        run_step bench 300 "$PY" -m bench.gpu --models ${GPU_CHECK_BENCH_MODELS:-smollm2-135m} \
          --decode-steps 16 --idle-steps 16 --json "$OUT/bench_gpu.json" ;;
    esac
  done
fi

"$PY" - "$STATUS" "$OUT/gpu_check.json" "$dry_run" "$((SECONDS - START))" <<'EOF' | tee -a "$LOG"
import json, sys
status, out, dry, total = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
steps = []
for line in open(status):
    name, state, rc, seconds = line.rstrip("\n").split("\t")
    steps.append({"step": name, "status": state, "rc": int(rc), "seconds": int(seconds)})
passed = bool(steps) and all(s["status"] == "ok" for s in steps)
json.dump({"dry_run": dry, "seconds": total, "passed": passed, "steps": steps}, open(out, "w"), indent=1)
for s in steps:
    print(f"{s['step']:8} {s['status']:8} {s['seconds']:4d}s")
print("gpu_check:", "every step passed" if passed else "some steps did not pass (see gpu_check.log)")
EOF
rm -f "$STATUS"
grep -q '"passed": true' "$OUT/gpu_check.json"
