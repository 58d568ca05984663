#!/usr/bin/env bash
# The whole GPU check in one command, for a CUDA machine (the H200 of the device tool, or any other):
#   build megakern._C, run the full test suite (GPU tests included), run every benchmark, and leave logs and
#   result files under $OUT (default: ./device-out).
#
#   MEGAKERN_GIT_SHA=$(git rev-parse --short HEAD) bash scripts/device_check.sh [build] [test] [bench] [profile]
#
# With no stage named, all four run. TESTS="tests/test_attention.py tests/models" picks test paths (the whole suite
# takes about 7 minutes with WORKERS=8 pytest workers on one GPU; on a host with several, the workers spread over
# them (MEGAKERN_TEST_GPUS, default every GPU): split it across calls
# that have a time limit, or give TEST_BUDGET_S so that the summary naming the failures is still printed).
# BENCHES="norm attention" picks benchmarks (default: every bench_*.py); each
# full benchmark takes minutes, so split them across calls when a call has a time limit. Wheels of missing Python packages (e.g. liger_kernel for the side-by-side
# benchmarks) are installed from .whl/ when present. Benchmark rows are appended to benchmarks/results/<gpu>/
# in this tree and copied to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
STAGES=${*:-build test bench profile}
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
status=0
want() { [[ " $STAGES " == *" $1 "* ]]; }
step() { echo; echo "=== $1 ($(date -u +%H:%M:%S))"; }

# the project's shared data files, where the tree carries them (cp ../shared/data/* .shared-data/ before the call)
[ -d .shared-data ] && export MEGAKERN_SHARED_DATA=$PWD/.shared-data

step environment
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.txt"
python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__)" | tee -a "$OUT/env.txt"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/megakern-site .whl/*.whl && \
    export PYTHONPATH=/tmp/megakern-site${PYTHONPATH:+:$PYTHONPATH}
fi

# megakern.models and megakern.parallel (models/ and parallel/ in the tree) import once the package is installed:
# an editable install without compiling (the build stage compiles the extension in place)
step "install (editable, pure Python)"
MEGAKERN_PURE_PYTHON=1 python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 \
  || { status=1; tail -20 "$OUT/install.log"; }
python3 -c "import megakern.models.gpt, megakern.parallel; print('megakern.models and megakern.parallel import')"

if want build; then
  step "build megakern._C"
  start=$(date +%s)
  python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { status=1; tail -40 "$OUT/build.log"; }
  echo "build: $(( $(date +%s) - start )) s"; tail -3 "$OUT/build.log"
  python3 -c "import megakern; print('CUDA path:', megakern.cuda_runtime())"
fi

if want test; then
  step "test suite"
  # TEST_BUDGET_S: end the session after so many seconds (pytest-timeout's --session-timeout), so that a call's time
  # limit cuts the tests, not the summary that names the failures
  budget=(); [ -n "${TEST_BUDGET_S:-}" ] && budget=(--session-timeout "$TEST_BUDGET_S")
  # the workers spread over every GPU of the host (tests/conftest.py); tests/parallel/test_multi_gpu.py then sees
  # one GPU per worker and skips: scripts/multi_gpu_check.sh runs it
  export MEGAKERN_TEST_GPUS=${MEGAKERN_TEST_GPUS:-$(nvidia-smi -L | wc -l)}
  echo "pytest workers: ${WORKERS:-8} over $MEGAKERN_TEST_GPUS GPU(s)"
  python3 -m pytest ${TESTS:-tests} -q -n ${WORKERS:-8} -p no:cacheprovider -rfE ${budget[@]+"${budget[@]}"} \
    --junitxml="$OUT/pytest.xml" > "$OUT/pytest.log" 2>&1 || status=1
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -40; tail -15 "$OUT/pytest.log"
fi

if want bench; then
  step benchmarks
  names=${BENCHES:-$(ls benchmarks/bench_*.py | sed 's|benchmarks/bench_||; s|\.py$||')}
  for name in $names; do
    python3 -m "benchmarks.bench_$name" ${BENCH_ARGS:-} > "$OUT/bench_$name.log" 2>&1 || { status=1; tail -30 "$OUT/bench_$name.log"; }
  done
  gpu=$(python3 -c "from benchmarks.common import gpu_slug; import torch; print(gpu_slug(torch.device('cuda')))")
  cp benchmarks/results/"$gpu"/*.csv "$OUT/" 2>/dev/null
  for name in $names; do sed -n '/^|/,$p' "$OUT/bench_$name.log"; done
fi

if want profile; then
  step "profile (ncu, one pass per kernel)"
  timeout 240 python3 profiles/profile_norm.py --ncu "$OUT/ncu_norm.csv" > "$OUT/profile.log" 2>&1 || { status=1; tail -20 "$OUT/profile.log"; }
  tail -25 "$OUT/profile.log"
fi

step "done (status $status)"
exit $status
