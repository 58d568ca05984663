#!/usr/bin/env bash
# The whole GPU check in one command, for a CUDA machine (the H200 of the device tool, or any other):
#   build megakern._C, run the full test suite (GPU tests included), run every benchmark, and leave logs and
#   result files under $OUT (default: ./device-out).
#
#   MEGAKERN_GIT_SHA=$(git rev-parse --short HEAD) bash scripts/device_check.sh [build] [test] [bench] [profile] [train]
#
# Take the sha where the commit is: a copy of the tree on another machine may carry an older .git.
#
# With no stage named, the first four run; "train" (the training steps of Llama shapes and a small model, and a
# profile of one step: several minutes), "peers" (attention, norms and cross-entropy beside FlashAttention-4,
# quack and cut-cross-entropy, carried in .peers2/, with liger from .whl/) and "tune" (the launch-table sweeps,
# TUNES) run when named. PACK=1 returns everything under $OUT as one archive, out.tgz.
# TESTS="tests/test_attention.py tests/models" picks test paths (the whole suite
# takes about 7 minutes with WORKERS=8 pytest workers on one GPU; on a host with several, the workers spread over
# them (MEGAKERN_TEST_GPUS, default every GPU): split it across calls
# that have a time limit, or give TEST_BUDGET_S so that the summary naming the failures is still printed).
# BENCHES="norm attention" picks benchmarks (default: every bench_*.py); each
# full benchmark takes minutes, so split them across calls when a call has a time limit. BENCH_TIMEOUT_S ends each
# benchmark (and each peers benchmark) after so many seconds with SIGTERM, on which it files the rows it has
# measured (benchmarks.common.keep_rows_on_exit), and SIGKILL 30 s later: give it less than the call's limit, whose
# own end may kill the process before it can file anything. Wheels of missing Python packages (e.g. liger_kernel for the side-by-side
# benchmarks) are installed from .whl/ when present. Benchmark rows are appended to benchmarks/results/<gpu>/
# in this tree and copied to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
fresh_out=; [ -z "$(ls -A "$OUT")" ] && fresh_out=1  # PACK empties only a folder this run filled
STAGES=${*:-build test bench profile}  # train only when named
bench_limit=(); [ -n "${BENCH_TIMEOUT_S:-}" ] && bench_limit=(timeout -k 30 "$BENCH_TIMEOUT_S")
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
status=0
want() { [[ " $STAGES " == *" $1 "* ]]; }
step() { echo; echo "=== $1 ($(date -u +%H:%M:%S))"; }
gpu_dir() { python3 -c "from benchmarks.common import gpu_slug; import torch; print(gpu_slug(torch.device('cuda')))"; }

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
    ${bench_limit[@]+"${bench_limit[@]}"} python3 -m "benchmarks.bench_$name" ${BENCH_ARGS:-} > "$OUT/bench_$name.log" 2>&1 \
      || { status=1; tail -30 "$OUT/bench_$name.log"; }
  done
  gpu=$(gpu_dir)
  cp benchmarks/results/"$gpu"/*.csv "$OUT/" 2>/dev/null
  for name in $names; do sed -n '/^|/,$p' "$OUT/bench_$name.log"; done
fi

if want profile; then
  step "profile (ncu, one pass per kernel)"
  timeout -k 20 240 python3 profiles/profile_norm.py --ncu "$OUT/ncu_norm.csv" > "$OUT/profile.log" 2>&1 || { status=1; tail -20 "$OUT/profile.log"; }
  tail -25 "$OUT/profile.log"
fi

if want peers; then
  # the frontier peers side by side (named only): FlashAttention-4, quack and cut-cross-entropy from .peers2 (see
  # ../shared/peers/README.md: a first call leaves the DSL's first part in /tmp/peers, this call must follow at once)
  # PEER_BENCHES picks among: attention norm cross_entropy. Attention over both head dims takes more than one call
  # of ten minutes (FlashAttention-4 compiles each shape): PEER_HEAD_DIMS=64, then 128, in two calls
  step "peers"
  # FlashAttention-4's compiled kernels in its own disk cache (keyed by its sources, Python and DSL versions), kept in
  # .peers-cache/fa4 of this tree: a tree that carries .peers-cache/ from an earlier call skips those compilations,
  # and $OUT/fa4-cache.tgz returns the cache for the next call to carry
  export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=${FLASH_ATTENTION_CUTE_DSL_CACHE_DIR:-$PWD/.peers-cache/fa4}
  mkdir -p "$FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"
  if [ ! -f .peers2/install.sh ]; then
    echo "peers: .peers2/ is not in this tree (carry it)"; status=1
  elif ! source .peers2/install.sh; then
    status=1
  else
    for name in ${PEER_BENCHES:-attention norm cross_entropy}; do
      case $name in
        attention) args=(--graph --providers megakern-triton,fa4,sdpa-cudnn --head-dims "${PEER_HEAD_DIMS:-64,128}"
                         --seqlens 1024,2048,4096,8192 --gqa 1,4) ;;
        norm) args=(--graph --hidden 1024,2048,3072,4096,5120,8192,12288,16384
                    --providers megakern-triton,quack,liger,compile) ;;
        cross_entropy) args=(--providers megakern-triton,compile,cce,quack,liger --tokens 8192) ;;
        *) echo "PEER_BENCHES: unknown $name"; status=1; continue ;;
      esac
      ${bench_limit[@]+"${bench_limit[@]}"} python3 -m "benchmarks.bench_$name" "${args[@]}" \
        > "$OUT/peers_$name.log" 2>&1 || { status=1; tail -30 "$OUT/peers_$name.log"; }
      sed -n '/^|/,$p' "$OUT/peers_$name.log" | head -60
    done
    gpu=$(gpu_dir)
    for name in ${PEER_BENCHES:-attention norm cross_entropy}; do
      cp benchmarks/results/"$gpu"/"$name".csv "$OUT/peers_${name}_$gpu.csv" 2>/dev/null
    done
    tar czf "$OUT/fa4-cache.tgz" -C "$FLASH_ATTENTION_CUTE_DSL_CACHE_DIR" . && \
      echo "peers: FlashAttention-4's kernel cache, $(du -sh "$OUT/fa4-cache.tgz" | cut -f1): $OUT/fa4-cache.tgz" \
           "(here: mkdir -p .peers-cache/fa4 && tar xzf fa4-cache.tgz -C .peers-cache/fa4; carry .peers-cache)"
  fi
fi

if want train; then
  # the training steps of the shapes people train (not part of the default stages): a small model against the plain
  # PyTorch GPT compiled, Llama-3.2-1B and Llama-3-8B's layer shape and GPT-350M against Hugging Face + compile, each
  # with megakern's defaults; then one eager Llama-1B step profiled (GPU time by source) into $OUT.
  # TRAIN_MODELS picks among: gpt-char llama-1b llama-8b-4l gpt-350m profile-llama-1b, and llama-8b-8l /
  # llama-8b-12l (the 8B layer shape with 8 or 12 layers), profile-llama-8b-4l and profile-gpt-char (named only).
  # TRAIN_ARGS are added to each bench_train call (e.g. "--warmup 8 --steps 20": more timed steps than --quick's
  # 3 + 8, whose ratios move by about 1% from run to run; the compiled model's warm-up, not the steps, is most of a
  # run's time)
  step "training steps"
  gpu=$(gpu_dir)
  for model in ${TRAIN_MODELS:-gpt-char llama-1b llama-8b-4l gpt-350m profile-llama-1b}; do
    case $model in
      gpt-char) args=(--model gpt-char --providers megakern,megakern-default,plain-compile --warmup 5 --steps 30) ;;
      llama-1b) args=(--model llama-1b --quick --providers megakern-default,hf-compile) ;;
      llama-8b-4l) args=(--model llama-8b --n-layer 4 --quick --providers megakern-default,hf-compile) ;;
      llama-8b-8l) args=(--model llama-8b --n-layer 8 --quick --providers megakern-default,hf-compile) ;;
      llama-8b-12l) args=(--model llama-8b --n-layer 12 --quick --providers megakern-default,hf-compile) ;;
      gpt-350m) args=(--quick --providers megakern-default,hf-compile) ;;
      profile-llama-1b|profile-llama-8b-4l|profile-gpt-char)
        # one eager step's GPU time by source (the profiled steps only: train.steps keeps the data check small)
        case $model in
          profile-llama-1b) shape=(model.preset=llama-1b model.max_seqlen=2048 train.micro_batch_size=4) ;;
          profile-llama-8b-4l) shape=(model.preset=llama-8b model.n_layer=4 model.max_seqlen=4096
                                      train.micro_batch_size=2) ;;
          profile-gpt-char) shape=(model.preset=gpt-tiny model.n_layer=6 model.n_embd=384 model.n_head=6
                                   model.max_seqlen=256 model.vocab_size=257 model.dropout=0.0 model.bias=false
                                   train.micro_batch_size=64) ;;
        esac
        name=${model#profile-}; name=${name//-/_}
        timeout -k 20 300 python3 -m megakern.train --profile "${shape[@]}" train.steps=20 train.precision=bf16 \
          train.cuda_graph=false eval.every=0 checkpoint.final=false train.sample_tokens=0 log.tensorboard=false \
          log.progress=false log.run_dir=/tmp/run-$name log.profile_dir=/tmp/profile-$name > "$OUT/profile_$name.log" 2>&1 \
          || { status=1; tail -20 "$OUT/profile_$name.log"; }
        # the tables only, flat in $OUT (the device tool returns few files; the trace is tens of MB)
        for table in /tmp/profile-$name/*/{kernels,timeline}.txt; do
          [ -f "$table" ] && cp "$table" "$OUT/profile_${name}_$(basename "$table")"
        done
        continue ;;
      *) echo "TRAIN_MODELS: unknown $model"; status=1; continue ;;
    esac
    python3 -m benchmarks.bench_train "${args[@]}" ${TRAIN_ARGS:-} > "$OUT/bench_train_$model.log" 2>&1 \
      || { status=1; tail -30 "$OUT/bench_train_$model.log"; }
    sed -n '/^|/,$p' "$OUT/bench_train_$model.log" | head -8
    # after each model: a call cut short by its time limit still returns the rows filed so far
    cp benchmarks/results/"$gpu"/train.csv "$OUT/train_$gpu.csv" 2>/dev/null
  done
fi

if want tune; then
  # the launch-table sweeps (named only): TUNES picks among: optim sumsq cross_entropy norm_fwd; their tables go to
  # $OUT/tune_<name>.txt (docs/tuning.md takes the winners)
  step "tuning sweeps"
  for name in ${TUNES:-optim sumsq cross_entropy norm_fwd}; do
    case $name in
      optim) cmd=(python3 profiles/tune_optim.py --model llama-1b) ;;
      sumsq) cmd=(python3 profiles/tune_optim.py --model llama-1b --sumsq) ;;
      cross_entropy) cmd=(python3 profiles/tune_cross_entropy.py) ;;
      norm_fwd) cmd=(python3 profiles/tune_norm.py --launchers "cuda fwd" --hidden "${TUNE_HIDDEN:-1024,4096,16384}") ;;
      *) echo "TUNES: unknown $name"; status=1; continue ;;
    esac
    timeout "${TUNE_TIMEOUT_S:-240}" "${cmd[@]}" > "$OUT/tune_$name.txt" 2>&1 \
      || { status=1; tail -20 "$OUT/tune_$name.txt"; }
    tail -40 "$OUT/tune_$name.txt"
  done
fi

step "done (status $status)"
# PACK=1: everything under $OUT in one archive (a device call returns only a few files)
if [ -n "${PACK:-}" ]; then
  tar czf /tmp/device-out.tgz -C "$OUT" . && mv /tmp/device-out.tgz "$OUT/out.tgz" \
    && { [ -z "$fresh_out" ] || find "$OUT" -mindepth 1 ! -name out.tgz -delete; }
fi
exit $status
