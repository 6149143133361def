#!/usr/bin/env bash
# The whole test suite, then `kvsieve bench gpu --json`, in one command (docs/gpu.md): on a GPU
# machine with the kit of ../shared/device/ carried (.devkit/), and the same on a CPU machine.
#
#   bash bench/datapath/gpu_suite.sh [--no-bench | --quick-bench | --no-suite] [OUT_DIR] [-- PYTEST_ARGS...]
#
# OUT_DIR (default $OUT, else ./gpu-suite) receives, as they come:
#   suite.txt       every test's name and outcome as it ends (-v), then the reasons of every
#                   failure and skip (-ra) and the slowest tests: a run cut short still names
#                   every test that ended before the cut
#   suite.xml       the junit file (pytest writes it when the suite ends)
#   bench_gpu.json  `kvsieve bench gpu --json`, its progress in bench_gpu.log
# Settings: KVSIEVE_SUITE_WORKERS (xdist workers; default cores - 2), KVSIEVE_SUITE_TIMEOUT (seconds
# a test may take; default 200 on the device, the project's 600 elsewhere), PYTHON (the interpreter),
# KVSIEVE_KIT=0|1 (source .devkit/on-device.sh or not; default: when it exists and a GPU is there).
# Exit status: the suite's if it failed, else the bench's.
set -uo pipefail # no -e: a failed suite still runs the bench, and both write what they have
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root" || exit 1
bench=full suite=1 out="" pytest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --no-bench) bench=none ;;
    --quick-bench) bench=quick ;;
    --no-suite) suite=0 ;;
    --) shift; pytest_args=("$@"); break ;;
    -*) echo "gpu_suite.sh: unknown option $1 (--no-bench, --quick-bench, --no-suite, OUT_DIR, -- PYTEST_ARGS)" >&2; exit 2 ;;
    *) out=$1 ;;
  esac
  shift
done
out=${out:-${OUT:-$root/gpu-suite}}
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 1
[ ${#pytest_args[@]} -gt 0 ] || pytest_args=(tests)

# The kit only where it belongs: a CPU machine that built .devkit/ must not install its wheels
# into /tmp or swap in random weights.
kit=${KVSIEVE_KIT:-}
if [ -z "$kit" ]; then
  kit=0
  if [ -f .devkit/on-device.sh ] && compgen -G '/dev/nvidia[0-9]*' >/dev/null; then kit=1; fi
fi
python=${PYTHON:-}
if [ "$kit" = 1 ]; then
  # Installs what the image lacks, writes random weights at the default model's place and exports
  # KVSIEVE_RANDOM_WEIGHTS=1, which the tests that need the real weights' answers skip on.
  # shellcheck disable=SC1091
  source .devkit/on-device.sh || { echo "gpu_suite.sh: .devkit/on-device.sh failed" >&2; exit 1; }
  export KVSIEVE_RANDOM_WEIGHTS=${KVSIEVE_RANDOM_WEIGHTS:-1} # a kit older than that variable
  python=${python:-python3}
  timeout=${KVSIEVE_SUITE_TIMEOUT:-200}
else
  [ -n "$python" ] || { [ -x .venv/bin/python ] && python=.venv/bin/python; } || python=python3
  timeout=${KVSIEVE_SUITE_TIMEOUT:-600}
fi
cores=$(nproc)
workers=${KVSIEVE_SUITE_WORKERS:-$((cores > 3 ? cores - 2 : 1))}
export PYTHONUNBUFFERED=1

suite_rc=0
if [ "$suite" = 1 ]; then
  echo "gpu_suite: $python, $workers workers, ${timeout} s a test, writing to $out"
  start=$(date +%s)
  # loadfile: a module's tests share one worker, so its model (and CUDA context) is loaded once there.
  "$python" -m pytest -v -ra -p xdist -n "$workers" --dist loadfile --timeout "$timeout" --durations 25 \
    --junitxml "$out/suite.xml" "${pytest_args[@]}" 2>&1 | tee "$out/suite.txt"
  suite_rc=${PIPESTATUS[0]}
  echo "gpu_suite: the suite exited $suite_rc after $(($(date +%s) - start)) s: $out/suite.txt, $out/suite.xml"
fi

bench_rc=0
if [ "$bench" != none ]; then
  flags=(--json)
  [ "$bench" = quick ] && flags+=(--quick)
  start=$(date +%s)
  "$python" -m kvstore.cli.main bench gpu "${flags[@]}" >"$out/bench_gpu.json" 2> >(tee "$out/bench_gpu.log" >&2)
  bench_rc=$?
  echo "gpu_suite: bench gpu exited $bench_rc after $(($(date +%s) - start)) s: $out/bench_gpu.json"
fi
[ "$suite_rc" -ne 0 ] && exit "$suite_rc"
exit "$bench_rc"
