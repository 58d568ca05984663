export PYTHONPATH=$PWD
python scripts/_graphdebug2.py 2>&1 | grep -E "graph table|grads after|replay ok|losses|ERROR" | head -8
python -m pytest -q tests/train/test_train.py tests/train/test_train_sync.py tests/test_optim.py tests/benchmarks/test_harness.py -k "gpu or optim" -p no:cacheprovider --tb=short 2>&1 | grep -v "DEBUG\|Warning" | grep -E "passed|failed|FAILED|Error" | tail -25
python -m benchmarks.bench_optim --quick 2>&1 | tail -3
python -m benchmarks.bench_optim --quick --graph 2>&1 | tail -3
python -m benchmarks.bench_train --quick --providers megakern,megakern-graph,hf-compile > $OUT/bench_train.txt 2>&1
grep -E "skip|Error|error" $OUT/bench_train.txt | head; grep -v "^|" $OUT/bench_train.txt | tail -8
cp benchmarks/results/*/optim.csv benchmarks/results/*/train.csv $OUT/
