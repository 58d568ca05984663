"""Expert parallelism: the routed experts of each MoE layer (models/moe.py) split over the ep ranks of an expert-
parallel group, tokens dispatched to them and combined back by all-to-all.

Layout (megakern.parallel.dims): ep ranks are carved out of the data-parallel ranks, dp x cp flattened, as
dp_cp_i = edp_i * ep + ep_i. ep rank r holds experts r * E/ep .. (r + 1) * E/ep - 1 of every MoE layer: ``w_in``
(E/ep, C, F or 2F) and ``w_out`` (E/ep, F, C), slices of the single model's (E, ...) tensors. Router, shared experts
and everything else stay whole (replicated over dp x cp as before).

One MoE layer's routed experts on an ep rank (``ExpertDispatcher``, the layer's ``dispatcher``), N tokens, top-k:

    plan = route_plan(expert_idx, E)              rows sorted by global expert: rank s's experts are one run
    xs = permute(x, plan)                         (N k, C), the kept assignments first (by expert), zeros after
    counts (E,) -> all_to_all -> got (ep, E/ep)   got[s, l]: rows rank s sends to my local expert l
    one host read of the split sizes              sent: counts summed per destination; received: got's rows
    recv = all_to_all(xs[:kept])                  (R, C) ordered by (source rank, local expert)
    y = expert_ffn(recv sorted by local expert)   the grouped GEMMs on my E/ep experts (stable sort: by source)
    back = all_to_all(y in arrival order)         (kept, C), each row back on the rank that sent it, plan order
    out = unpermute([back; zeros], weights, plan) the weighted combine of the token's k choices (fp32 sum)

The all-to-alls carry autograd: the backward of one is the reverse all-to-all with the split sizes swapped.
Dropless (the default), the split sizes are exchanged first (all_to_all_single with per-rank sizes), not a padded
dispatch: a padded buffer would either drop tokens or be sized for the worst case (every token to one rank: ep times
the traffic); the price is one host read per layer and micro-batch (Megatron-LM's and torchtitan's all-to-all
dispatchers read them too), which a CUDA graph cannot capture.

With a capacity factor (the layer keeps at most ``cap`` = ceil(factor N k / E) assignments per expert of its N
tokens) the dispatch has fixed sizes and reads nothing on the host (``_fixed``):

    plan = padded_plan(route_plan(expert_idx, E), cap)   expert e owns rows e cap .. (e + 1) cap, kept ones first
    xs = permute(x, plan)                         (E cap, C): rank s's slots are rows s S .. (s + 1) S, S = E/ep cap
    counts (E,) -> all_to_all -> got (ep, E/ep)   on the device only: which received rows hold a token
    recv = all_to_all(xs), S rows each way        (ep S, C) as (source rank, local expert, slot)
    y = expert_ffn(recv's valid rows sorted by local expert, then source; the empty ones after)
    back = all_to_all(y in arrival order)         (E cap, C) in the padded plan's rows
    out = unpermute(back, weights, plan)

It moves factor x the dropless traffic at a balanced routing (the empty slots travel too) but computes the experts on
the kept rows only, and its shapes are the same every step: a CUDA-graph step captures it. The dispatch is kept out
of torch.compile (``torch.compiler.disable``).

Gradients: every rank backpropagates (its tokens' loss sum) * dp * cp / N_global and a local expert's gradient already
sums the contributions of the whole ep group's tokens, so the expert gradients are summed over the expert-data-
parallel group (dp * cp / ep replicas of the same experts) and divided by dp * cp: the single model's gradient. Under
DDP (and the by-hand replication) ``reduce_expert_grads`` does it after the backward. Under FSDP2 each MoE layer's
w_in / w_out are their own ``fully_shard`` unit over the edp ranks (``expert_data_mesh``; torchtitan's layout):
sharded there, all-gathered for forward and backward there, their gradients reduce-scattered there with the sum
divided by dp * cp (not FSDP2's average over edp). The dense parameters are averaged over dp x cp as before. Under
sequence parallel the expert gradients are partial sums over tp like the rest of the MoE layer's (all-reduced over tp
afterwards); without it every tp rank computes them on the same tokens.

Checkpoints (``expert_checkpoint_mesh``, ``as_global_expert``): each rank's slice is a DTensor sharded on dim 0 of
the single model's (E, ...) tensor over the ep dim of a ("tp", "ep", "edp") mesh of the pipeline stage's ranks,
replicated over tp and over edp (or, under FSDP2, sharded there as FSDP2 shards it: the ep slice's dim 0 or 1), so
torch.distributed.checkpoint writes each expert once and loads it under another ep, with DDP or FSDP2.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from megakern.moe import padded_plan, permute, permute_rows, route_plan, unpermute
from megakern.parallel.data_parallel import SeparateShard, allreduce_tensors

EXPERT_WEIGHTS = ("w_in", "w_out")


# ---- the all-to-all with autograd ----------------------------------------------------------------------------------
def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows of ``x`` (sum(in_splits), ...): in_splits[s] rows to rank s of ``group``; returns the sum(out_splits)
    rows received, out_splits[s] from rank s, in rank order. Differentiable (torch.distributed.nn's all-to-all: the
    backward is the reverse all-to-all)."""
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    return dist_nn.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits), group=group)


# ---- the dispatcher ------------------------------------------------------------------------------------------------
class ExpertDispatcher:
    """An MoE layer's routed experts over an ep group (see the module docstring): ``layer.dispatcher``, called as
    ``layer.experts(x, expert_idx, weights)`` is. ``layer``'s w_in / w_out hold this rank's E / ep experts."""

    def __init__(self, layer: nn.Module, group, ep: int, ep_rank: int):
        self.layer, self.group, self.ep, self.ep_rank = layer, group, ep, ep_rank
        self.n_experts = layer.n_experts
        self.n_local = layer.n_experts // ep

    @torch.compiler.disable
    def __call__(self, x: torch.Tensor, expert_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        device = x.device
        dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else x.dtype
        cap = self.layer.expert_capacity(x.shape[0])
        if cap is None:
            return self._dropless(x.to(dtype), expert_idx, weights)
        return self._fixed(x.to(dtype), expert_idx, weights, cap)

    def _fixed(self, x: torch.Tensor, expert_idx: torch.Tensor, weights: torch.Tensor, cap: int) -> torch.Tensor:
        """The capacity-limited dispatch: fixed split sizes, no host read (the module docstring)."""
        layer, ep, n_local = self.layer, self.ep, self.n_local
        device = x.device
        plan = padded_plan(route_plan(expert_idx, self.n_experts), cap)
        xs = permute(x, plan, backend=layer.kernels)                    # (E cap, C): slots by expert
        with torch.no_grad():
            got = torch.empty_like(plan.counts)
            dist.all_to_all_single(got, plan.counts, group=self.group)   # got[s l]: rank s's rows for my expert l
        splits = [n_local * cap] * ep
        recv = all_to_all(xs, splits, splits, self.group)                # (ep S, C): (source, local expert, slot)
        with torch.no_grad():
            got = got.view(ep, n_local, 1)
            slot = torch.arange(cap, device=device).view(1, 1, cap)
            by_expert = (torch.arange(n_local, device=device).view(1, n_local, 1) * ep
                         + torch.arange(ep, device=device).view(ep, 1, 1))
            key = torch.where(slot < got, by_expert, n_local * ep).reshape(-1)
            order = torch.sort(key, stable=True).indices                 # valid rows by local expert, then source
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(order.numel(), device=device)
            offsets = torch.zeros(n_local + 1, dtype=torch.int64, device=device)
            offsets[1:] = torch.cumsum(got.sum(0).view(-1), 0)
        y = permute_rows(layer.expert_ffn(permute_rows(recv, order, inverse), offsets), inverse, order)
        back = all_to_all(y, splits, splits, self.group)                 # (E cap, C): the plan's rows
        return unpermute(back, weights, plan, backend=layer.kernels)

    def _dropless(self, x: torch.Tensor, expert_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The dropless dispatch: split sizes exchanged and read on the host (the module docstring)."""
        layer, ep, n_local = self.layer, self.ep, self.n_local
        device = x.device
        plan = route_plan(expert_idx, self.n_experts)
        xs = permute(x, plan, backend=layer.kernels)                     # (N k, C): kept rows first, by expert
        with torch.no_grad():
            send = plan.counts.view(ep, n_local).contiguous()           # rows for rank s's local expert l
            got = torch.empty_like(send)
            dist.all_to_all_single(got, send, group=self.group)          # got[s, l]: rank s's rows for my expert l
            sizes = torch.stack([send.sum(1), got.sum(1)]).tolist()      # the split sizes, read on the host
        in_splits, out_splits = sizes
        kept, received = sum(in_splits), sum(out_splits)
        recv = all_to_all(xs[:kept], out_splits, in_splits, self.group)  # (R, C) by source rank, then local expert
        with torch.no_grad():
            local = torch.arange(n_local, device=device).repeat(ep)
            key = torch.repeat_interleave(local, got.reshape(-1), output_size=received)
            order = torch.sort(key, stable=True).indices                 # by local expert, then source rank
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(received, device=device)
            offsets = torch.zeros(n_local + 1, dtype=torch.int64, device=device)
            offsets[1:] = torch.cumsum(got.sum(0), 0)
        if received:
            # permute_rows: each reorder's gradient is the inverse's gather (no zero-fill and scatter-add)
            y = permute_rows(layer.expert_ffn(permute_rows(recv, order, inverse), offsets), inverse, order)
        else:  # nothing for this rank's experts: one zero row keeps them (zero gradients) and the empty
            # dispatch (whose backward is a collective every rank of the group joins) in the graph
            y = layer.expert_ffn(torch.cat([recv, recv.new_zeros(1, recv.shape[1])]), offsets)[:0]
        back = all_to_all(y, in_splits, out_splits, self.group)          # (kept, C) in the plan's order
        rows = plan.order.numel()
        if kept < rows:
            back = torch.cat([back, back.new_zeros(rows - kept, back.shape[1])])
        return unpermute(back, weights, plan, backend=layer.kernels)


# ---- applying it ---------------------------------------------------------------------------------------------------
def apply_expert_parallel(gpt: nn.Module, group, ep: int, ep_rank: int) -> list[str]:
    """Give each MoE layer of ``gpt`` (a GPT or a pipeline stage of one, materialized or on the meta device) this
    rank's E / ep experts and an ``ExpertDispatcher`` over ``group``, in place; returns the expert weights' names
    (relative to ``gpt``)."""
    names = []
    for bname, block in gpt.blocks.items():
        layer = block.mlp
        if not getattr(layer, "is_moe", False):
            continue
        if layer.n_experts % ep:
            raise ValueError(f"expert parallel: block {bname} has {layer.n_experts} experts, not divisible by "
                             f"ep={ep}")
        n = layer.n_experts // ep
        for pname in EXPERT_WEIGHTS:
            p = getattr(layer, pname)
            if p.shape[0] != layer.n_experts:
                raise ValueError(f"expert parallel: block {bname}'s {pname} holds {p.shape[0]} experts, not all "
                                 f"{layer.n_experts} (applied twice?)")
            setattr(layer, pname, nn.Parameter(p.detach()[ep_rank * n:(ep_rank + 1) * n].clone(),
                                               requires_grad=p.requires_grad))
            names.append(f"blocks.{bname}.mlp.{pname}")
        layer.dispatcher = ExpertDispatcher(layer, group, ep, ep_rank)
    return names


@torch.no_grad()
def reduce_expert_grads(grads: list[torch.Tensor], edp_group, dp_cp: int) -> None:
    """The expert weights' gradients, in place: summed over the expert-data-parallel group (None or one rank: no
    collective) and divided by dp * cp (see the module docstring)."""
    if not grads:
        return
    if edp_group is not None and dist.get_world_size(edp_group) > 1:
        allreduce_tensors(grads, edp_group)
    torch._foreach_mul_(grads, 1.0 / dp_cp)


# ---- FSDP2 ---------------------------------------------------------------------------------------------------------
def expert_data_mesh(pm) -> DeviceMesh:
    """The 1-D ("edp",) DeviceMesh of this rank's expert-data-parallel group (the dp * cp / ep ranks of its pipeline
    stage and tp coordinate holding the same experts), with its process group: what FSDP2 shards and reduces the
    expert weights over. ``pm``: a ParallelMesh with ep > 1. With one rank per group (ep = dp * cp) the groups of one
    rank are made here: every rank must call this alike (it may make process groups), once per mesh."""
    d = pm.dims
    if pm.local or d.ep == 1:
        raise ValueError(f"expert_data_mesh: the mesh has no expert parallelism (ep={d.ep}, "
                         f"{'local' if pm.local else f'world {d.world_size}'})")
    group = pm.edp_group
    if group is None:  # edp = 1: each rank its own group
        group, _ = dist.new_subgroups_by_enumeration([[r] for r in range(d.world_size)])
    if dist.get_world_size(group) != d.edp:
        raise RuntimeError(f"expert_data_mesh: the edp group has {dist.get_world_size(group)} ranks, the layout "
                           f"dp * cp / ep = {d.dp} * {d.cp} / {d.ep} = {d.edp}")
    return DeviceMesh.from_group(group, pm.device_type, mesh_dim_names=("edp",))


def expert_shards(gpt: nn.Module, mesh: DeviceMesh, dp_cp: int) -> list[SeparateShard]:
    """FSDP2 units of ``gpt``'s expert weights (after ``apply_expert_parallel``): each MoE layer's own parameters,
    w_in and w_out (its router and shared experts are its children and stay with the block), sharded over ``mesh``
    (``expert_data_mesh``), their gradients summed there and divided by ``dp_cp`` (dp * cp: the module docstring).
    Each is sharded on dim 0 (its E / ep experts) where the edp ranks divide them, else on dim 1 where they divide it
    (fewer local experts than edp ranks: dim 0 would leave ranks without a shard), else on dim 0 unevenly."""
    edp = mesh.size()

    def placement(p: torch.Tensor) -> Shard:
        return Shard(0) if p.shape[0] % edp == 0 or p.shape[1] % edp else Shard(1)

    shards = []
    for layer in gpt.moe_layers():
        own = dict(layer.named_parameters(recurse=False))
        if set(own) != set(EXPERT_WEIGHTS):
            raise ValueError(f"expert_shards: MoE layer {layer.row} holds parameters {sorted(own)} of its own; "
                             f"expected exactly {list(EXPERT_WEIGHTS)}")
        shards.append(SeparateShard(layer, mesh, float(dp_cp), placement))
    return shards


# ---- checkpoints ---------------------------------------------------------------------------------------------------
def expert_checkpoint_mesh(pm) -> DeviceMesh:
    """("tp", "ep", "edp") mesh of this rank's pipeline stage, without process groups (DCP asks it only for
    coordinates). The ep dim comes before edp: under FSDP2 the edp ranks shard the ep slice (mesh order = order of
    sharding)."""
    d = pm.dims
    ranks = torch.arange(d.world_size).reshape(d.pp, d.edp, d.ep, d.tp)[pm.pp_rank]  # (edp, ep, tp)
    grid = ranks.permute(2, 1, 0).contiguous()
    return DeviceMesh(pm.device_type, grid, mesh_dim_names=("tp", "ep", "edp"), _init_backend=False)


def as_global_expert(t: torch.Tensor, mesh: DeviceMesh, ep: int) -> DTensor:
    """This rank's (E / ep, ...) slice ``t`` as dim-0 shard of the single model's (E, ...) tensor; ``t`` may be an
    FSDP2 DTensor over the edp ranks (``expert_shards``): its local shard, placed there as FSDP2 placed it."""
    if isinstance(t, DTensor):
        (edp,) = t.placements
        local = t.to_local()
    else:
        edp, local = Replicate(), t
    shape = (t.shape[0] * ep,) + tuple(t.shape[1:])  # a DTensor's shape is the whole ep slice's
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return DTensor.from_local(local, mesh, [Replicate(), Shard(0), edp], run_check=False,
                              shape=torch.Size(shape), stride=tuple(reversed(stride)))
