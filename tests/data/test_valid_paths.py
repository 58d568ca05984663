"""data.valid_paths: eval reads separate validation datasets (one, or a blend by data.valid_weights) and training
every document of data.paths; the config's and the data's mistakes (overlap with data.paths, weights of the wrong
count, no data.paths, another tokenizer) are named."""
import random

import pytest

from megakern.config import ConfigError, load_config
from megakern.data import ByteTokenizer, DataError, build_data, load_tokenizer
from megakern.data.preprocess import preprocess_documents


def _corpus(prefix, letters: str, n: int, seed: int, tokenizer=None):
    rng = random.Random(seed)
    docs = ["".join(rng.choice(letters) for _ in range(rng.randint(20, 60))) for _ in range(n)]
    preprocess_documents(docs, tokenizer or ByteTokenizer(), prefix, progress=False)
    return prefix


def _config(tmp_path, train, valid, *extra):
    return load_config(None, ["train.device=cpu", "train.steps=2", "train.micro_batch_size=2", "model.max_seqlen=32",
                              "train.seq_length=16", f"data.paths=[{','.join(map(str, train))}]",
                              f"data.valid_paths=[{','.join(map(str, valid))}]", "eval.batches=2", *extra])


def test_eval_reads_the_validation_datasets_only(tmp_path):
    train = _corpus(tmp_path / "train", "abcdefghijklm", 60, 0)
    valid_a = _corpus(tmp_path / "valid_a", "nopqrs", 30, 1)
    valid_b = _corpus(tmp_path / "valid_b", "tuvwxyz", 30, 2)
    for valid, extra in (([valid_a], []), ([valid_a, valid_b], ["data.valid_weights=[3,1]"])):
        config = _config(tmp_path, [train], valid, *extra)
        data = build_data(config, seq_length=16, eval_seq_length=16, train_samples=8, eval_samples=8,
                          log=lambda m: None)
        letters = set()
        for i in range(len(data.valid)):
            letters |= {chr(t) for t in data.valid[i]["tokens"].tolist() if t < 256}
        assert letters and letters <= set("nopqrstuvwxyz"), letters
        assert bool(letters & set("tuvwxyz")) == (len(valid) > 1)  # the second dataset only in the blend
        seen = set()
        for i in range(len(data.train)):
            seen |= {chr(t) for t in data.train[i]["tokens"].tolist() if t < 256}
        assert seen <= set("abcdefghijklm")
        assert "eval on data.valid_paths" in data.description and "0 documents held out" in data.description


def test_mistakes_are_named(tmp_path):
    train = _corpus(tmp_path / "train", "abc", 20, 0)
    valid = _corpus(tmp_path / "valid", "xyz", 20, 1)
    with pytest.raises(ConfigError, match="also in data.paths"):
        _config(tmp_path, [train], [train])
    with pytest.raises(ConfigError, match="data.valid_weights has 2 entries for 1 data.valid_paths"):
        _config(tmp_path, [train], [valid], "data.valid_weights=[1,2]")
    with pytest.raises(ConfigError, match="data.valid_paths needs data.paths"):
        load_config(None, [f"data.valid_paths=[{valid}]"])
    chars = tmp_path / "chars.txt"
    chars.write_text("xyz")
    other = _corpus(tmp_path / "other", "xyz", 20, 2, tokenizer=load_tokenizer(f"char:{chars}"))
    config = _config(tmp_path, [train], [other])
    with pytest.raises(DataError, match="data.valid_paths were tokenized by .*, data.paths by byte"):
        build_data(config, seq_length=16, eval_seq_length=16, train_samples=8, eval_samples=8, log=lambda m: None)
