# one-off check on the GPU machine (not committed)
export PYTHONPATH=$PWD
python scripts/_graphdebug.py 2>&1 | grep -E "tables_for|losses|Error" | tail -8
python scripts/_graphdebug.py train.global_batch_size=16 2>&1 | grep -E "losses|Error" | tail -3
python -m pytest -q tests/train/test_train.py tests/train/test_train_sync.py tests/test_optim.py -k "gpu or optim" -p no:cacheprovider --tb=short 2>&1 | grep -v "DEBUG\|Warning" | grep -E "passed|failed|FAILED|Error" | tail -25
python -m benchmarks.bench_train --quick --providers megakern,megakern-graph,hf-compile > $OUT/bench_train.txt 2>&1
grep -E "skip|Error|error" $OUT/bench_train.txt | head; grep -v "^|" $OUT/bench_train.txt | tail -8; grep "MFU" $OUT/bench_train.txt
cp benchmarks/results/*/train.csv $OUT/
