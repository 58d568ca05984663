"""Mixture-of-Experts MLP: a router picks k of E experts per token, the experts run as grouped GEMMs over the tokens
sorted by expert (megakern.moe: route_plan, permute, grouped_mm, unpermute), optional shared experts see every token.

    x (N, C) -> logits = x W_r^T (N, E), fp32 (autocast off)
    softmax router:  p = softmax(logits); choice = p; weights = p[top-k] (renormalized to sum 1 if asked)
    sigmoid router:  s = sigmoid(logits); choice = s + bias (DeepSeek-V3's auxiliary-loss-free balancing: the bias
                     chooses experts, it never weights them); weights = s[top-k] (renormalized if asked)
    group-limited:   experts in G groups of E/G; a group's score is its best choice (softmax) or the sum of its two
                     best (sigmoid, as DeepSeek-V3); only the topk_groups best groups are eligible
    experts:         y = sum_j weights[t, j] expert_{idx[t, j]}(x_t) (+ shared(x_t)), expert(x) = act(x W_in) W_out
                     with W_in (E, C, F) (SwiGLU: (E, C, 2F), columns 2i / 2i + 1 the gate / up of unit i, as the
                     dense MLP's rows) and W_out (E, F, C): stacked so the grouped GEMM takes them as they are;
                     act the config's activation (SwiGLU, the tanh GELU, or the erf GELU for "gelu_exact")

Capacity (``moe_capacity_factor``; None is dropless): expert e keeps at most ceil(factor * N * k / E) of its
assignments, those with the highest router scores (the softmax probability or sigmoid affinity, before
renormalization); ties go to the earlier assignment (a = t * k + j). Score order keeps what the router is surest of
and, unlike token order, does not drop the late positions of every sequence first. Dropped assignments get
expert_idx -1: their token keeps its other experts' weighted outputs (no renormalization) and the residual stream.

Losses, per micro-batch (N tokens, A = N k assignments chosen by the router, before capacity):
    aux (Switch / Mixtral load balancing) = E * sum_e f_e P_e, f_e = (assignments to e) / A (no gradient),
          P_e = mean_t p_te (softmax probabilities; the sigmoid router's scores normalized over the experts);
          1.0 when perfectly balanced
    z (ST-MoE router z-loss) = mean_t logsumexp(logits_t)^2
``moe_aux_loss_coef * aux + moe_z_loss_coef * z`` reaches the gradient through ``AuxLoss`` on the layer's output
(Megatron's MoEAuxLossAutoScaler): identity forward; backward also sends d(loss) = ``aux_loss_scale`` to the
losses, so they count on every pipeline stage without travelling to the loss. The caller sets the scale (the
training step: 1 / micro-batches of a rank's step, times cp; see megakern.parallel.ParallelModel.forward_backward).

Token shards: when a parallel plan gives this layer only part of a micro-batch's tokens (sequence parallel, context
parallel), ``shard_tokens`` names how to sum over the other parts; f_e then counts the whole micro-batch and each
part's aux and z are its share of the whole micro-batch's (their sum over the parts is the unsharded value).

Expert parallelism: ``dispatcher`` (None here) is what computes the routed experts when a parallel plan sets it
(megakern.parallel.expert: the tokens travel by all-to-all to the ranks holding their experts, whose ``w_in`` /
``w_out`` are then this rank's slices of the E experts); it is called as ``experts`` is and may call
``expert_ffn`` on the rows it received.

Statistics: with a (L, STAT_WIDTH) fp32 tensor given (``track_statistics``), each training micro-batch adds to this
layer's row, in the backward (so a recomputed forward or a forward without a backward counts nothing): tokens routed
to each expert (E columns), kept and routed assignments, aux and z (this part's share), non-finite router logits,
and the micro-batch's share (1 / parts). Nothing is read on the host: a step that routes can be captured in a CUDA
graph. Non-finite logits make the output non-finite (softmax) or are counted (sigmoid's +-inf), so the training step
skips the step and leaves the bias alone (``update_expert_bias``'s ``skip``).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megakern.activation import swiglu
from megakern.moe import grouped_mm, permute, route_plan, unpermute

ROUTERS = ("softmax", "sigmoid")

# columns of a layer's statistics row after its E per-expert counts
KEPT, ROUTED, AUX, Z, NONFINITE, SHARE = range(6)
STAT_EXTRA = 6


def stat_width(n_experts: int) -> int:
    """Columns of one layer's statistics row."""
    return n_experts + STAT_EXTRA


class Routing(NamedTuple):
    """A router's decision for N tokens: ``expert_idx`` (N, k) int64 (-1: dropped by the capacity), ``weights``
    (N, k) fp32 (the combine's), ``score`` (N, k) fp32 (the router's score of each choice before renormalization: the
    capacity's order), ``probs`` (N, E) fp32 (what the aux loss averages), ``routed`` (N, k) the choices before
    the capacity."""
    expert_idx: torch.Tensor
    weights: torch.Tensor
    score: torch.Tensor
    probs: torch.Tensor
    routed: torch.Tensor


# ---- router math (fp32) --------------------------------------------------------------------------------------------
def route(logits: torch.Tensor, top_k: int, *, router: str = "softmax", bias: Optional[torch.Tensor] = None,
          renormalize: bool = False, n_groups: int = 1, topk_groups: int = 1) -> Routing:
    """Top-k routing of ``logits`` (N, E) (computed in fp32); see the module docstring. ``bias`` (E,): the sigmoid
    router's balancing bias (added to the choice only). Returns Routing with nothing dropped."""
    logits = logits.float()
    n, e = logits.shape
    if router == "softmax":
        probs = torch.softmax(logits, dim=-1)
        scores = probs
        choice = probs
    elif router == "sigmoid":
        scores = torch.sigmoid(logits)
        probs = scores / scores.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        choice = scores if bias is None else scores + bias.float()
    else:
        raise ValueError(f"route: router must be one of {ROUTERS}, got {router!r}")
    if n_groups > 1:
        grouped = choice.view(n, n_groups, e // n_groups)
        if router == "softmax":
            group_score = grouped.amax(-1)
        else:
            group_score = grouped.topk(min(2, e // n_groups), dim=-1).values.sum(-1)
        keep = group_score.topk(topk_groups, dim=-1).indices  # (N, topk_groups)
        mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(e // n_groups, dim=1), float("-inf"))
    idx = choice.topk(top_k, dim=-1).indices  # (N, k), the best first
    score = scores.gather(1, idx)
    weights = score
    if renormalize:
        weights = score / score.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return Routing(idx, weights, score, probs, idx)


def capacity(n_tokens: int, top_k: int, n_experts: int, factor: Optional[float]) -> Optional[int]:
    """Assignments an expert keeps: ceil(factor * N * k / E), or None (dropless)."""
    if factor is None:
        return None
    return max(1, math.ceil(factor * n_tokens * top_k / n_experts))


def drop_over_capacity(expert_idx: torch.Tensor, score: torch.Tensor, n_experts: int, cap: int) -> torch.Tensor:
    """``expert_idx`` (N, k) with -1 where an expert's assignment ranks at ``cap`` or later in its expert's order:
    the highest ``score`` first, ties to the earlier assignment (t * k + j). Deterministic; no host read."""
    flat = expert_idx.reshape(-1)
    by_score = torch.sort(-score.reshape(-1).float(), stable=True).indices  # descending score, ties in order
    order = by_score[torch.sort(flat[by_score], stable=True).indices]       # by expert, then by score
    counts = _count(flat, n_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(flat)
    rank[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    return torch.where(rank < cap, flat, torch.full_like(flat, -1)).view_as(expert_idx)


def _count(flat: torch.Tensor, n_experts: int) -> torch.Tensor:
    """(E,) int64: how often each of 0 .. E-1 occurs in ``flat`` (others not counted). A scatter-add, not
    torch.bincount, which reads its input's max on the host on CUDA."""
    key = torch.where((flat < 0) | (flat >= n_experts), torch.full_like(flat, n_experts), flat)
    return torch.zeros(n_experts + 1, dtype=torch.int64, device=flat.device).scatter_add_(
        0, key, torch.ones_like(key))[:n_experts]


def expert_counts(expert_idx: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Assignments per expert (E,) fp32, -1 (dropped) not counted."""
    return _count(expert_idx.reshape(-1), n_experts).float()


def load_balancing_loss(probs: torch.Tensor, counts: torch.Tensor, n_tokens: float) -> torch.Tensor:
    """E * sum_e f_e P_e with f_e = counts_e / sum(counts) (no gradient) and P_e = sum_t probs_te / ``n_tokens``:
    the Switch / Mixtral aux loss (``n_tokens``: the whole micro-batch's tokens when ``probs`` holds a part)."""
    e = probs.shape[1]
    f = counts.detach() / counts.detach().sum().clamp_min(1.0)
    return e * (f * probs.sum(0)).sum() / n_tokens


def router_z_loss(logits: torch.Tensor, n_tokens: float) -> torch.Tensor:
    """sum_t logsumexp(logits_t)^2 / ``n_tokens`` (ST-MoE's z-loss; the mean when the logits are the whole batch)."""
    return torch.logsumexp(logits.float(), dim=-1).square().sum() / n_tokens


@torch.no_grad()
def update_expert_bias(bias: torch.Tensor, load: torch.Tensor, rate: float,
                       skip: Optional[torch.Tensor] = None) -> None:
    """DeepSeek-V3's auxiliary-loss-free update, in place: bias_e += rate * sign(mean(load) - load_e) (an
    overloaded expert is chosen less, an underloaded one more). ``load`` (E,): tokens routed to each expert over the
    step (all micro-batches and data-parallel ranks). ``skip``: a device bool (or 0/1) tensor; where set, or where
    the load is not finite, the bias is left as it is (no host read)."""
    load = load.float()
    delta = rate * torch.sign(load.mean() - load)
    bad = ~torch.isfinite(load).all()
    if skip is not None:
        bad = bad | (skip.reshape(()) != 0)
    bias.add_(torch.where(bad, torch.zeros_like(delta), delta).to(bias.dtype))


# ---- the aux loss's way to the gradient ------------------------------------------------------------------------------
class AuxLoss(torch.autograd.Function):
    """out -> out; the backward also gives ``loss`` the gradient ``scale`` and adds ``sample`` to ``stats`` (once
    per micro-batch's backward). ``loss`` may be None (no coefficient)."""

    @staticmethod
    def forward(ctx, out, loss, scale: float, stats, sample):
        ctx.scale, ctx.stats, ctx.sample = scale, stats, sample
        ctx.loss_dtype = loss.dtype if loss is not None else None
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.stats is not None:
            ctx.stats.add_(ctx.sample)
        dloss = None
        if ctx.loss_dtype is not None:
            dloss = torch.full((), ctx.scale, dtype=ctx.loss_dtype, device=grad_out.device)
        return grad_out, dloss, None, None, None


# ---- the layer -----------------------------------------------------------------------------------------------------
class Router(nn.Module):
    """The gate: ``weight`` (E, C); with the sigmoid router a persistent ``expert_bias`` (E,) fp32 buffer."""

    def __init__(self, n_embd: int, n_experts: int, bias_buffer: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, n_embd))
        if bias_buffer:
            self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=torch.float32))
        else:
            self.expert_bias = None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C) -> (N, E) fp32, autocast off."""
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.weight.float())


class MoEMLP(nn.Module):
    """The MoE MLP of a block (config: a megakern.models.gpt.GPTConfig with n_experts > 0). ``shared``: the shared
    experts' dense MLP (every token), or None. ``row``: this layer's row in the statistics."""

    is_moe = True

    def __init__(self, config, shared: Optional[nn.Module] = None, row: int = 0):
        super().__init__()
        c = config
        self.n_experts, self.top_k, self.ffn_hidden = c.n_experts, c.moe_top_k, c.moe_ffn_hidden
        self.swiglu = c.activation == "swiglu"
        self.gelu = "none" if c.activation == "gelu_exact" else "tanh"  # F.gelu's approximate, without swiglu
        self.router_kind, self.renormalize = c.moe_router, c.moe_renormalize
        self.n_groups, self.topk_groups = c.moe_n_groups, c.moe_topk_groups
        self.capacity_factor, self.force_balance = c.moe_capacity_factor, c.moe_force_balance
        self.aux_coef, self.z_coef = c.moe_aux_loss_coef, c.moe_z_loss_coef
        self.bias_rate = c.moe_bias_update_rate
        self.dropout, self.kernels = c.dropout, c.kernels  # kernels: ops "moe" and "grouped_mm" (megakern.moe)
        self.row = row
        self.router = Router(c.n_embd, c.n_experts, bias_buffer=c.moe_router == "sigmoid")
        self.w_in = nn.Parameter(torch.empty(c.n_experts, c.n_embd, c.moe_ffn_hidden * (2 if self.swiglu else 1)))
        self.w_out = nn.Parameter(torch.empty(c.n_experts, c.moe_ffn_hidden, c.n_embd))
        self.shared = shared
        self.aux_loss_scale = 1.0
        self.dispatcher = None  # a parallel plan's experts(x, expert_idx, weights) (expert parallelism)
        self.stats: Optional[torch.Tensor] = None
        self._reducers, self.token_parts = [], 1

    # -- what the training step and the parallel plans set --
    def shard_tokens(self, reduce, parts: int) -> None:
        """This layer sees one of ``parts`` equal parts of each micro-batch's tokens; ``reduce(t)`` returns ``t``
        summed over the ranks holding the other parts (no autograd). Called once per sharding (sequence parallel,
        context parallel): the parts multiply."""
        self._reducers.append(reduce)
        self.token_parts *= parts

    def track_statistics(self, stats: Optional[torch.Tensor]) -> None:
        """Accumulate into row ``self.row`` of ``stats`` (L, stat_width(E)) fp32 (None: no statistics)."""
        self.stats = stats

    def update_bias(self, load: torch.Tensor, skip: Optional[torch.Tensor] = None) -> None:
        """The sigmoid router's bias from this layer's step load (E,) (``update_expert_bias``); nothing otherwise."""
        if self.router.expert_bias is not None and self.bias_rate:
            update_expert_bias(self.router.expert_bias, load, self.bias_rate, skip)

    # -- forward --
    def expert_capacity(self, n_tokens: int) -> Optional[int]:
        """Assignments each expert keeps of ``n_tokens`` tokens (the part of a micro-batch this layer sees), or None
        (dropless)."""
        return capacity(n_tokens, self.top_k, self.n_experts, self.capacity_factor)

    def routing(self, logits: torch.Tensor) -> Routing:
        """The router's decision for ``logits`` (N, E), the capacity applied."""
        r = route(logits, self.top_k, router=self.router_kind, bias=self.router.expert_bias,
                  renormalize=self.renormalize, n_groups=self.n_groups, topk_groups=self.topk_groups)
        if self.force_balance:
            r = self._random_choice(logits, r)
        cap = self.expert_capacity(logits.shape[0])  # of this part's N
        if cap is None:
            return r
        return r._replace(expert_idx=drop_over_capacity(r.expert_idx, r.score, self.n_experts, cap))

    def _random_choice(self, logits: torch.Tensor, r: Routing) -> Routing:
        """``moe_force_balance`` (benchmarks): k distinct experts per token drawn uniformly (the default generator),
        weighted by the router's scores of them (renormalized if asked); the aux loss's probabilities stay the
        router's."""
        idx = torch.rand(logits.shape, device=logits.device).topk(self.top_k, dim=-1).indices
        scores = torch.softmax(logits.float(), -1) if self.router_kind == "softmax" else torch.sigmoid(logits.float())
        score = scores.gather(1, idx)
        weights = score
        if self.renormalize:
            weights = score / score.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        return Routing(idx, weights, score, r.probs, idx)

    def experts(self, x: torch.Tensor, expert_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_j weights[t, j] expert_{idx[t, j]}(x_t) for x (N, C) (dropped choices skipped)."""
        dtype = (torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type)
                 else self.w_in.dtype)
        plan = route_plan(expert_idx, self.n_experts)
        xs = permute(x.to(dtype), plan, backend=self.kernels)            # (N k, C) by expert
        y = self.expert_ffn(xs, plan.offsets)                            # (N k, C)
        return unpermute(y, weights, plan, backend=self.kernels)         # (N, C), the combine in fp32

    def expert_ffn(self, xs: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The experts this layer holds (``w_in`` (E', C, F or 2F), ``w_out`` (E', F, C)) on rows sorted by expert:
        rows offsets[e] .. offsets[e + 1] of xs (M, C) through expert e, (M, C) in xs's dtype; offsets (E' + 1,)."""
        h = grouped_mm(xs, self.w_in.to(xs.dtype), offsets, backend=self.kernels)  # (M, F or 2F)
        if self.swiglu:
            h = swiglu(h, backend=self.kernels)
        else:
            h = F.gelu(h, approximate=self.gelu)
        return grouped_mm(h, self.w_out.to(xs.dtype), offsets, backend=self.kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        logits = self.router.logits(x2)                                  # (N, E) fp32
        r = self.routing(logits)
        out = (self.experts if self.dispatcher is None else self.dispatcher)(x2, r.expert_idx, r.weights)
        if self.shared is not None:
            out = out + self.shared(x2).to(out.dtype)
        out = out.view(*shape[:-1], out.shape[-1])
        if self.dropout:
            out = F.dropout(out, self.dropout, self.training)
        if self.training and torch.is_grad_enabled():
            out = self._attach_losses(out, logits, r)
        return out

    def _attach_losses(self, out, logits, r: Routing) -> torch.Tensor:
        n_local = logits.shape[0]
        routed = expert_counts(r.routed, self.n_experts)                 # this part's counts
        total = routed
        for reduce in self._reducers:                                    # the whole micro-batch's
            total = reduce(total)
        n_all = float(n_local * self.token_parts)
        aux = load_balancing_loss(r.probs, total, n_all)
        z = router_z_loss(logits, n_all)
        loss = None
        if self.aux_coef:
            loss = self.aux_coef * aux
        if self.z_coef:
            loss = self.z_coef * z if loss is None else loss + self.z_coef * z
        sample = None
        if self.stats is not None:
            with torch.no_grad():
                kept = (r.expert_idx >= 0).sum().float()
                extra = torch.stack([kept, kept.new_full((), float(r.routed.numel())), aux.detach(), z.detach(),
                                     (~torch.isfinite(logits)).sum().float(), kept.new_full((), 1.0 / self.token_parts)])
                sample = torch.cat([routed, extra])
        if loss is None and sample is None:
            return out
        return AuxLoss.apply(out, loss, self.aux_loss_scale, None if sample is None else self.stats[self.row], sample)

    def extra_repr(self) -> str:
        return (f"experts={self.n_experts}, top_k={self.top_k}, ffn_hidden={self.ffn_hidden}, "
                f"router={self.router_kind}, capacity_factor={self.capacity_factor}")
