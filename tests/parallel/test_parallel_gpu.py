"""World size 1 on a GPU: NCCL, the fast kernels (bf16, Triton attention / norms / rotary), through the whole
ParallelModel path (init with timeout, agreement, mesh, parallelize, forward_backward, clipping, checkpoint
state), against the plain model."""
import pytest
import torch
from conftest import HAS_CUDA
from rankpool import free_port, spawn

pytestmark = pytest.mark.gpu


def _world_of_one(rank, port):
    import copy

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp  # noqa: F401 - imported as the trainer would

    from megakern.models.gpt import GPT, GPTConfig
    from megakern.parallel import ParallelDims, init_distributed, parallelize

    init_distributed(backend="nccl", rank=0, world_size=1, master_addr="127.0.0.1", master_port=port, timeout=120)
    cfg = GPTConfig.preset("llama-tiny", max_seqlen=512)
    pm = ParallelDims().build("cuda", timeout=120, agree={"config": cfg})
    torch.manual_seed(0)
    ref = GPT(cfg).to(device="cuda", dtype=torch.bfloat16)
    pmodel = parallelize(copy.deepcopy(ref), pm, None)
    opt = pmodel.build_optimizer(torch.optim.AdamW, lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    g = torch.Generator(device="cuda").manual_seed(1)
    out = []
    for _ in range(3):
        idx = torch.randint(0, cfg.vocab_size, (4, 512), device="cuda", generator=g)
        targets = torch.randint(0, cfg.vocab_size, (4, 512), device="cuda", generator=g)
        ref_loss = ref(idx, targets)
        ref_loss.backward()
        loss = pmodel.forward_backward(idx, targets)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        norm = pmodel.clip_grad_norm_(1.0)
        out.append((float(loss), float(ref_loss), float(norm), float(ref_norm)))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    state = pmodel.checkpoint_state(opt)
    assert set(state["model"]) == {n for n, _ in ref.named_parameters()}
    dist.destroy_process_group()
    return out


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_world_size_one_nccl_fast_kernels():
    steps = spawn(_world_of_one, [0], free_port(), timeout=300)[0]
    for loss, ref_loss, norm, ref_norm in steps:
        assert abs(loss - ref_loss) <= 2e-2 * abs(ref_loss), steps
        assert abs(norm - ref_norm) <= 5e-2 * abs(ref_norm), steps
