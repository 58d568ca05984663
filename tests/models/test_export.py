"""megakern-export on CPU: a checkpoint of a short llama-tiny run written as a Hugging Face directory that
transformers loads, with megakern's logits (fp32, 1e-4) and its greedy tokens; bad input named with exit code 2,
nothing written. (A checkpoint saved by two FSDP ranks: tests/train/test_train.py.)"""
import shutil

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install '.[hf]')")
pytest.importorskip("safetensors", reason="safetensors is not installed (pip install '.[hf]')")

from megakern.config import load_config  # noqa: E402
from megakern.models.export import main as export, read_checkpoint  # noqa: E402

V = 257  # the default corpus's byte tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from megakern.train import Trainer

    tmp = tmp_path_factory.mktemp("export")
    config = load_config(None, ["model.preset=llama-tiny", "model.n_layer=2", "train.device=cpu", "train.steps=2",
                                "train.micro_batch_size=2", "log.progress=false", "log.tensorboard=false",
                                "train.sample_tokens=0", "data.num_workers=0", "eval.every=0",
                                f"log.run_dir={tmp / 'run'}", f"data.cache_dir={tmp / 'data'}"])
    Trainer(config, stream=open(tmp / "console.txt", "a")).run()
    return tmp / "run" / "checkpoints"


def _greedy(logits_fn, idx, n):
    for _ in range(n):
        idx = torch.cat([idx, logits_fn(idx)[:, -1, :V].argmax(-1, keepdim=True)], dim=1)
    return idx


def test_export_matches_the_checkpoint(tmp_path, checkpoint, capsys):
    from transformers import AutoModelForCausalLM

    assert export([str(checkpoint), str(tmp_path / "hf")]) == 0
    assert "megakern-export: " in capsys.readouterr().out
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    model, config, found = read_checkpoint(checkpoint)
    model.eval()
    assert found.name == "step_00000002" and config.n_layer == 2
    idx = torch.randint(0, V, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(exported(idx).logits, model(idx)[..., :V], rtol=0, atol=1e-4)
        want = _greedy(lambda t: model(t), idx[:1, :5], 10)
        got = exported.generate(idx[:1, :5], max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)


def test_export_bad_input(tmp_path, checkpoint, capsys):
    assert export([str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("x")
    assert export([str(checkpoint), str(taken)]) == 2
    assert "not an empty directory; nothing written" in capsys.readouterr().err
    assert [p.name for p in taken.iterdir()] == ["mine.txt"]
    bare = tmp_path / "bare" / "step_00000002"
    shutil.copytree(checkpoint / "step_00000002", bare)
    (bare / "config.yaml").unlink()
    assert export([str(bare), str(tmp_path / "out2")]) == 2
    assert "no config.yaml" in capsys.readouterr().err
    assert not (tmp_path / "out2").exists()
    # a corrupt tensor file: the manifest's sha256 names it (skipped with --no-verify, DCP reads what is there)
    shard = next(bare.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    (bare / "config.yaml").write_text((checkpoint / "step_00000002" / "config.yaml").read_text())
    assert export([str(bare), str(tmp_path / "out3")]) == 2
    assert "sha256 differs from the manifest" in capsys.readouterr().err
