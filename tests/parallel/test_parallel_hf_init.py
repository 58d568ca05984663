"""A parallel run started from an imported Hugging Face checkpoint (parallelize(init_state=...), what
model.init_from=hf:DIR does in megakern-train): under tp2 with sequence parallel on gloo ranks, each rank keeps its
slices of the checkpoint's weights and the model's loss equals the single imported model's."""
import pytest
import torch
from rankpool import pool

pytest.importorskip("transformers", reason="transformers is not installed (pip install '.[hf]')")
pytest.importorskip("safetensors", reason="safetensors is not installed (pip install '.[hf]')")

V = 300


def _checkpoint(tmp_path, family: str):
    """A tiny random transformers model saved as a Hugging Face directory."""
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                           bos_token_id=0, eos_token_id=0))
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=64, bos_token_id=0, eos_token_id=0))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(tmp_path / family)
    return tmp_path / family


def _tp2_from_hf(path):
    """Under tp2 with sequence parallel (gloo ranks): the mean loss of a batch of a model built on the meta device and
    started from the checkpoint's weights (each rank its slices), and the single imported model's."""
    from megakern.models import hf
    from megakern.models.gpt import GPT
    from megakern.parallel import ParallelDims, parallelize

    state, config = hf.read_state(path, lazy=True)  # as the trainer reads it: memory-mapped, a block at a time
    single, _ = hf.load(path)
    pm = ParallelDims(tp=2).build("cpu", timeout=60)
    with torch.device("meta"):
        model = GPT(config)
    pmodel = parallelize(model, pm, None, init_state=state, sequence_parallel=True)
    g = torch.Generator().manual_seed(5)
    idx = torch.randint(0, V, (2, 32), generator=g)
    targets = torch.randint(0, V, (2, 32), generator=g)
    pmodel.eval()
    single.eval()
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        logits = reference(idx).logits  # (B, T, V): transformers' softmax over the real vocabulary only
        theirs = torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
        return float(pmodel.eval_loss(idx, targets)), float(single(idx, targets)), float(theirs)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_parallel_model_starts_from_the_checkpoint(tmp_path, family):
    """The tp2 model's loss is the single imported model's, and both are transformers' (V = 300, padded to 384: the
    padding columns are left out of the softmax, the vocab-parallel loss's last shard and the single model's slice)."""
    path = _checkpoint(tmp_path, family)
    for got, want, theirs in pool(2).run(_tp2_from_hf, str(path)):
        assert abs(got - want) <= 1e-5 * abs(want), (got, want)
        assert abs(want - theirs) <= 1e-5 * abs(theirs), (want, theirs)
