# one-off check on the GPU machine (not committed)
export PYTHONPATH=$PWD
python -m pytest -q tests/train/test_train.py tests/train/test_train_sync.py tests/test_optim.py -k "gpu or optim" -p no:cacheprovider --tb=short 2>&1 | grep -v "DEBUG\|Warning" | tail -25
python -m benchmarks.bench_optim --quick 2>&1 | tail -3
python -m benchmarks.bench_optim --quick --graph 2>&1 | tail -3
python profiles/tune_optim.py
python -m benchmarks.bench_train --quick --providers megakern,megakern-graph,hf-compile 2>&1 | grep -v "^|" | tail -12
cp benchmarks/results/*/optim.csv benchmarks/results/*/train.csv $OUT/
