#!/usr/bin/env bash
# The parallel stack on a machine with several GPUs, in one command (NVLink multicast off):
#   1. tests/parallel/test_multi_gpu.py: the training program under torchrun in every layout the GPUs allow
#      (NCCL), against the same run on one GPU;
#   2. benchmarks/bench_parallel.py for GPT-350M (layouts over 1..4 GPUs, or 1..8 on a machine with 8: CUDA-graph
#      steps where they can run, communication hidden), then GPT-1.3B,
#      while the time budget lasts.
#
#   3. (stage "profile") bench_parallel --profile: rank 0's kernel and host tables and every rank's timeline of
#      each GPT-350M layout, in one file $OUT/profiles.txt.
#   4. (stage "ops") benchmarks/bench_tp_overlap.py: the sequence-parallel GEMMs with their collectives, fused and
#      unfused, eager and in CUDA graphs, at tp 2 and 4 up to the GPUs here (rows to tp_overlap.csv); OPS_TP picks
#      the sizes, OPS_SHAPES the (M,K,N) cases, e.g. GPT-1.3B's layers:
#      OPS_SHAPES=8192,2048,6144:8192,2048,8192:8192,8192,2048:8192,2048,2048
#
#   MEGAKERN_GIT_SHA=$(git rev-parse --short HEAD) BUDGET_S=520 bash scripts/multi_gpu_check.sh [test] [bench] [profile] [ops]
#
# TESTS_K selects test layouts (pytest -k, e.g. TESTS_K=graph); LAYOUTS_350M, LAYOUTS_13B the benchmarked layouts
# (e.g. LAYOUTS_350M=1-graph,tp2-graph,tp2-ovl-graph,dp2-ddp-graph: CUDA-graph steps).
#
# With no stage named, test and bench run.
# Logs and result rows go to $OUT (default ./device-out): rows are appended to benchmarks/results/<gpu>/parallel.csv
# (and tp_overlap.csv) and copied to $OUT/parallel_<gpu>.csv (and $OUT/tp_overlap_<gpu>.csv). Rows lost with a run's CSV: bench_parallel --from-log LOG --meta ... (its log).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# the tree's commit for the result rows (a copy of the tree may carry a stale .git)
[ -n "${MEGAKERN_GIT_SHA:-}" ] || echo "note: MEGAKERN_GIT_SHA is not set; result rows take this copy's git HEAD"
export MEGAKERN_GIT_SHA=${MEGAKERN_GIT_SHA:-}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
deadline=$(( $(date +%s) + ${BUDGET_S:-520} ))
left() { echo $(( deadline - $(date +%s) )); }
step() { echo; echo "=== $1 ($(date -u +%H:%M:%S), $(left) s left)"; }
status=0
STAGES=${*:-test bench}
want() { [[ " $STAGES " == *" $1 "* ]]; }

if want test && { want bench || want profile; } && [ "${BUDGET_S:-520}" -lt 600 ]; then
  echo "note: the test stage takes about 250 s on 4 GPUs and bench about 300 s (profile 130 s): with BUDGET_S=${BUDGET_S:-520}"
  echo "      the test stage may be cut; run 'test' in a call of its own (on a 600 s call limit)"
fi

step environment
nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$OUT/env.txt"
nvidia-smi topo -m | head -8 | tee -a "$OUT/env.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, 'nccl', torch.cuda.nccl.version())" | tee -a "$OUT/env.txt"
MEGAKERN_PURE_PYTHON=1 python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 \
  || { status=1; tail -20 "$OUT/install.log"; }

if want test; then
step "multi-GPU layouts against one GPU (NCCL)"
reserve=10; want bench && reserve=300; want profile && reserve=$(( reserve + 120 ))
timeout -k 20 $(( $(left) - reserve )) python3 -m pytest tests/parallel/test_multi_gpu.py -q -s -p no:cacheprovider -rfEs \
  --tb=short ${TESTS_K:+-k "$TESTS_K"} > "$OUT/multi_gpu_tests.log" 2>&1 || status=1
grep -E "^(FAILED|ERROR|SKIPPED)|multi-gpu" "$OUT/multi_gpu_tests.log" | head -60; tail -3 "$OUT/multi_gpu_tests.log"
if [ -z "${TESTS_K:-}" ]; then  # the fault tests' two-GPU cases (the single-GPU suite spreads one GPU per worker)
  timeout -k 20 $(( $(left) - reserve )) python3 -m pytest tests/train/test_faults.py -q -p no:cacheprovider -rfEs \
    --tb=short -k cuda > "$OUT/fault_tests.log" 2>&1 || status=1
  grep -E "^(FAILED|ERROR)" "$OUT/fault_tests.log" | head; tail -2 "$OUT/fault_tests.log"
fi
fi

if want profile; then
step "profiles gpt-350m"
timeout -k 20 $(( $(left) - 30 )) python3 -m benchmarks.bench_parallel --model gpt-350m --micro-batch 8 --warmup 3 \
  --layouts ${LAYOUTS_PROFILE:-1-graph,tp2-graph,tp2-ovl-graph,dp2-ddp-graph,1,tp2} --profile "$OUT/prof" --timeout -k 20 200 > "$OUT/profile.log" 2>&1 || status=1
grep -E "FAILED|profile \(|^#" "$OUT/profile.log"
cat "$OUT"/prof/*.txt > "$OUT/profiles.txt" 2>/dev/null; rm -rf "$OUT/prof"
fi

if want bench; then
# default layouts by the machine's GPUs: on 8, the 8-GPU layouts (the 3-D tp2 x pp2 x dp2 among them) first, then
# what 4 GPUs measured already (cut by the time budget first)
gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
if [ "${gpus:-0}" -ge 8 ]; then
  default_350m=1-graph,1,1x8-graph,dp8-ddp-graph,tp2.dp4-ddp-graph,tp8-graph,tp2.pp2.dp2,pp2.dp4,dp4-ddp-graph,tp4-graph
  default_13b=1-graph,1,tp8-graph,tp2.pp2.dp2,dp8,tp4-graph,tp2-graph
else
  default_350m=1-graph,1x2-graph,dp2-ddp-graph,tp2-graph,tp2-ovl-graph,cp2-ddp-graph,dp4-ddp-graph,tp2.dp2-ddp-graph,tp4-graph,pp2,dp2
  default_13b=1-graph,tp2-graph,tp2-ovl-symm-graph,tp4-graph,tp4-ovl-symm-graph,tp2-ovl-graph,dp4
fi
step "bench_parallel gpt-350m"
timeout -k 20 $(( $(left) - 60 )) python3 -m benchmarks.bench_parallel --model gpt-350m --micro-batch 8 --warmup 3 --steps 8 \
  --layouts ${LAYOUTS_350M:-$default_350m} --overlap --timeout -k 20 200 \
  > "$OUT/bench_parallel_350m.log" 2>&1 || status=1
grep -v "^|" "$OUT/bench_parallel_350m.log" | tail -25

if [ "$(left)" -gt 90 ]; then
  step "bench_parallel gpt-1.3b"
  timeout -k 20 $(( $(left) - 5 )) python3 -m benchmarks.bench_parallel --model gpt-1.3b --micro-batch 4 --warmup 3 --steps 6 \
    --layouts ${LAYOUTS_13B:-$default_13b} --overlap --timeout -k 20 150 > "$OUT/bench_parallel_1.3b.log" 2>&1 || status=1
  grep -v "^|" "$OUT/bench_parallel_1.3b.log" | tail -12
fi
fi
if want ops; then
step "bench_tp_overlap"
timeout -k 20 $(( $(left) - 5 )) python3 -m benchmarks.bench_tp_overlap ${OPS_TP:+--tp $OPS_TP} ${OPS_SHAPES:+--shapes $OPS_SHAPES} \
  > "$OUT/bench_tp_overlap.log" 2>&1 \
  || status=1
grep -E "hides|^\| case|fwd-graph" "$OUT/bench_tp_overlap.log" | tail -40
fi
# one file per GPU kind (a plain cp of several parallel.csv into $OUT kept only the first: h100's, not the run's)
for f in benchmarks/results/*/parallel.csv benchmarks/results/*/tp_overlap.csv; do
  [ -f "$f" ] && cp "$f" "$OUT/$(basename "$f" .csv)_$(basename "$(dirname "$f")").csv"
done
step "done (status $status)"
exit $status
