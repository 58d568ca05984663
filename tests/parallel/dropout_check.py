"""Rank-side checks for dropout under tensor (+ sequence) parallelism: the ranks' masks are recorded, checked for
the structure the RNG tracker promises (one mask per replicated activation on all tp ranks, distinct masks per tp
rank on sequence shards, distinct per dp rank), and the single-process model replays them, assembled to whole
tensors: its losses, clip norms, gradients and parameters must equal the parallel run's."""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import set_checkpoint_early_stop
from gpt_check import ATOL, RTOL, batches, check_step, compare_to_reference, tiny_config

from megakern.models.gpt import GPT
from megakern.parallel import ParallelDims, RNGTracker, parallelize

_DROPOUT = F.dropout


@contextlib.contextmanager
def recording(masks: list):
    """F.dropout as usual; each call's keep-mask appended to ``masks``."""

    def dropout(x, p=0.5, training=True, inplace=False):
        out = _DROPOUT(x, p, training, inplace)
        if training and p > 0 and not x.is_meta:  # (a pipeline stage's shape inference runs on meta tensors)
            masks.append((out != 0).detach().clone())  # x is never exactly 0 here (random activations)
        return out

    F.dropout = dropout
    try:
        yield masks
    finally:
        F.dropout = _DROPOUT


@contextlib.contextmanager
def replaying(masks: list):
    """F.dropout applying the given keep-masks in order (x * mask / (1 - p), as torch's dropout does)."""
    queue = list(masks)

    def dropout(x, p=0.5, training=True, inplace=False):
        if not (training and p > 0):
            return x
        mask = queue.pop(0)
        assert mask.shape == x.shape, f"replayed mask {tuple(mask.shape)} for an activation {tuple(x.shape)}"
        return x * (mask.to(x.dtype) / (1 - p))

    F.dropout = dropout
    try:
        yield
    finally:
        F.dropout = _DROPOUT
    assert not queue, f"{len(queue)} recorded masks were not used by the single-process model"


def assemble(gathered, pp: int, dp: int, tp: int, sequence_parallel: bool) -> list:
    """The whole-batch masks, in the single model's order, from every rank's [(pp_rank, dp_rank, tp_rank, masks)]
    (one micro-batch: pipeline stage 0's draws, then stage 1's, ...), checking their structure."""
    by = {(s, d, t): m for s, d, t, m in gathered}
    full = []
    for s, i in ((s, i) for s in range(pp) for i in range(len(by[(s, 0, 0)]))):
        rows = []
        for d in range(dp):
            parts = [by[(s, d, t)][i] for t in range(tp)]
            if sequence_parallel:  # shards of different tokens: tp streams, distinct masks
                for t in range(1, tp):
                    assert not torch.equal(parts[t], parts[0]), f"call {i}: tp ranks 0 and {t} drew the same mask"
                # token shards (B, T / tp, C): runs of the (B, T) tokens in rank order
                shape = (*parts[0].shape[:1], parts[0].shape[1] * tp, *parts[0].shape[2:])
                rows.append(torch.cat([p.reshape(-1) for p in parts]).view(shape))
            else:  # a replicated activation: one mask on every tp rank
                for t in range(1, tp):
                    assert torch.equal(parts[t], parts[0]), f"call {i}: tp ranks 0 and {t} drew different masks"
                rows.append(parts[0])
        for d in range(1, dp):
            assert not torch.equal(rows[d], rows[0]), f"call {i}: dp ranks 0 and {d} drew the same mask"
        full.append(torch.cat(rows, dim=0))
    return full


def check_dropout(layout: dict, options: dict, style: str = "gpt", steps: int = 2, global_batch: int = 4,
                  seqlen: int = 16, p: float = 0.3, seed: int = 11, max_norm: float = 0.05, recompute: str = "none"):
    cfg = tiny_config(style)
    cfg.dropout, cfg.recompute = p, recompute  # "full": the backward's recomputation must redraw the same masks
    torch.manual_seed(0)
    ref = GPT(cfg)
    model = copy.deepcopy(ref)
    pm = ParallelDims(**layout).build("cpu", timeout=60)
    pmodel = parallelize(model, pm, None, seed=seed, **options)
    sp = pmodel.sequence_parallel
    assert pmodel.dropout_region == ("tensor_parallel" if sp else "replicated")
    d = pm.dims
    b = global_batch // d.dp
    mine = slice(pm.dp_rank * b, (pm.dp_rank + 1) * b)
    opt = pmodel.build_optimizer(torch.optim.SGD, lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    # the default generators differ per rank: the masks must come from the tracker alone
    torch.manual_seed(1000 + dist.get_rank())
    outside = torch.default_generator.get_state()
    # a single process forked to the same "replicated" state draws the same masks (dp = 1, no sequence parallel)
    own = RNGTracker(seed, "cpu") if d.dp == 1 and not sp else None
    kept = []
    for step, (idx, targets) in enumerate(batches(steps, global_batch, seqlen, cfg.vocab_size)):
        # (recomputation without early stop: it would end inside the last dropout, before the recording)
        with recording([]) as masks, set_checkpoint_early_stop(False):
            loss = pmodel.forward_backward(idx[mine], targets[mine])
        assert torch.equal(torch.default_generator.get_state(), outside), "dropout drew from the default generator"
        # pipelining (torch 2.13) first runs each stage once on placeholder inputs to infer shapes, dropout included
        # (the tracker advances, harmlessly): the step's own draws are the last ones
        forward = sum(int(g.wte is not None) + 2 * len(g.blocks) for g in pmodel.gpts)
        if recompute == "full":  # the backward recomputes blocks (as far as it needs them): the same masks again
            redrawn = masks[forward:]
            assert len(redrawn) == 2 * cfg.n_layer, len(masks)
            for i, again in enumerate(redrawn):
                assert any(torch.equal(again, m) for m in masks[1:forward]), \
                    f"step {step}: recomputed dropout call {i} drew a mask the forward did not"
            expected = len(masks)
        else:
            expected = forward
        assert len(masks) == expected or (step == 0 and d.pp > 1 and len(masks) == 2 * expected), len(masks)
        masks = masks[len(masks) - expected:]
        # the single model replays the calls in the same order (its recomputation too)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (pm.pp_rank, pm.dp_rank, pm.tp_rank, masks))
        full = assemble(gathered, d.pp, d.dp, d.tp, sp)
        assert recompute == "full" or len(full) == 1 + 2 * cfg.n_layer, len(full)
        kept.extend(float(m.float().mean()) for m in full)
        if own is not None:
            with recording([]) as drawn, own.fork("replicated"), torch.no_grad():
                ref(idx, targets)
            for i, (a, w) in enumerate(zip(drawn, full)):
                assert torch.equal(a, w), f"step {step} call {i}: the single process draws other masks"
        with replaying(full), set_checkpoint_early_stop(False):
            ref_loss = ref(idx, targets)
            ref_loss.backward()
        check_step(pmodel, ref, opt, ref_opt, loss, ref_loss, step, max_norm)
    compare_to_reference(pmodel, ref, "final parameters", grads=False)
    rate = 1 - sum(kept) / len(kept)
    assert abs(rate - p) < 0.05, f"dropped {rate:.3f} of the activations, want {p}"
    # eval: no dropout, the plain model's loss
    idx, targets = batches(1, global_batch, seqlen, cfg.vocab_size)[0]
    pmodel.eval()
    ref.eval()
    with torch.no_grad():
        ref_eval = ref(idx, targets)
    torch.testing.assert_close(pmodel.eval_loss(idx[mine], targets[mine]), ref_eval, rtol=RTOL, atol=ATOL)
    return float(loss), pmodel.rng.seed_of(pmodel.dropout_region, pmodel.stage_indices[0])
