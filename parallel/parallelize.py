"""Apply a parallel layout to a built GPT: ``parallelize(model, mesh_or_dims, config) -> ParallelModel``.

Order (torchtitan's "parallelize after build"): pipeline stages are cut from the model (pipeline.py), each stage is
sharded for tensor (+ sequence) parallelism (tensor_parallel.py), the attention cores become ring attention under
context parallelism (context.py), parameters are materialized (a model built on the meta device is initialized
shard by shard exactly as the single model's ``init_weights`` would), and data parallelism wraps each stage
(data_parallel.py). The model file stays a single-device model.

Loss and gradients: ``forward_backward(idx, targets)`` takes this data-parallel rank's batch and returns the mean
cross-entropy over the global batch (every dp rank's non-ignored tokens), equal on all ranks. Each rank
backpropagates (sum of its tokens' losses) * dp * cp / N_global; DDP / FSDP average over the dp x cp ranks, so
the gradients are those of the global mean, as the single-process model's on the whole batch. After the
backward: gradients that are partial sums over tp (sequence-parallel norms and biases) are all-reduced over tp, and
a tied head's copy on the last pipeline stage is summed with wte's on the first.

Dropout: each stage's forward runs inside the RNG tracker's region (rng.py): "replicated" (one mask on all tp
ranks) for the residual stream, or "tensor_parallel" (a mask per tp rank) when sequence parallel shards it.
Packed documents: ``forward_backward(idx, targets, cu_seqlens=...)`` in every layout (no document may cross a
micro-batch boundary); under context parallelism each micro-batch is laid out for the packed ring
(context.cp_pack_layout), under a pipeline each micro-batch's packing travels with it (pipeline.packed_microbatches).

Expert parallelism (ep > 1, expert.py): after tensor and context parallelism each MoE layer keeps this rank's E / ep
experts and dispatches its tokens by all-to-all. The expert weights stay out of DDP (and of the by-hand replication):
their gradients are summed over the expert-data-parallel group and divided by dp * cp after the backward. Under FSDP2
each MoE layer's experts are an FSDP2 unit of their own over the expert-data-parallel ranks (nested in the block's
unit over dp x cp), which reduce-scatters their gradients there with that sum and division. The clipping norm counts
them once per ep group (their FSDP2 shards once per edp group); checkpoints hold them as dim-0 shards of the (E, ...)
tensors. ZeRO-1 is refused with ep > 1 (see ``ParallelModel``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from megakern._checks import document_lengths
from megakern.config import ParallelConfig
from megakern.parallel.clip import clip_coefficient, grad_norm
from megakern.parallel.context import RingAttention, cp_positions, cp_shard
from megakern.parallel.data_parallel import (DP_SHARDS, allreduce_tensors, apply_ddp, apply_fsdp,
                                             broadcast_params, set_grad_sync, zero1_optimizer)
from megakern.parallel.dims import ParallelDims, ParallelMesh
from megakern.parallel.expert import (apply_expert_parallel, as_global_expert, expert_checkpoint_mesh,
                                      expert_data_mesh, expert_shards, reduce_expert_grads)
from megakern.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megakern.parallel.mappings import all_reduce
from megakern.parallel.master import MasterWeights
from megakern.parallel.pipeline import PipelineChunk, build_schedule, check_schedule, cut_stage, stage_layout
from megakern.parallel.rng import RNGTracker
from megakern.parallel.state_dict import as_global, checkpoint_mesh, group_hparams, init_optimizer_state
from megakern.parallel.overlap import all_gather_gemm, gemm_reduce_scatter
from megakern.parallel.symmetric import GATHERS as SYMMETRIC_GATHERS
from megakern.parallel.symmetric import PIECES as SYMMETRIC_PIECES
from megakern.parallel.symmetric import SIGNALS as SYMMETRIC_SIGNALS
from megakern.parallel.symmetric import SymmetricWorkspace, symmetric_memory_usable
from megakern.parallel.tensor_parallel import apply_tensor_parallel

# tp_overlap_impl -> the SymmetricWorkspace's rs_impl (overlap.py: how a GEMM + reduce-scatter moves its partial sums)
SYMMETRIC_IMPLS = {"symmetric": "copy", "symmetric-kernel": "kernel"}

IGNORE_INDEX = -100


def parallelize(model: nn.Module, mesh: ParallelMesh | ParallelDims, config: ParallelConfig | None = None, *,
                generator=None, rng: RNGTracker | None = None, seed: int | None = None,
                master_weights: bool = False, read_model_grads: bool = False, fp8=None,
                compile: bool | str = False, init_state: dict | None = None, cuda_graph: bool = False,
                **overrides) -> ParallelModel:
    """Shard ``model`` (a megakern.models.gpt.GPT, materialized or on the meta device) over ``mesh``.

    ``config``: the ParallelConfig whose choices apply (default ``ParallelConfig()``; its sizes are the mesh's, which
    is what counts here); keywords override its fields (``microbatches=4``, ``dp_shard="ddp"``, ...).
    ``generator``: for a meta-device model, the generator of its initialization (as ``GPT.init_weights``).
    ``init_state``: for a meta-device model, the whole model's weights to start from instead ({name: tensor} in the
    single GPT's names and shapes, e.g. megakern.models.hf's import; any device): each rank copies its slices.
    ``rng``: the dropout RNG tracker of this rank (default: ``RNGTracker.from_mesh(seed, mesh)``, ``seed`` defaulting
    to the initialization generator's initial seed when there is one, else 0).
    ``master_weights``: bf16 parameters with fp32 master weights (Megatron's and megakern-train's bf16 precision):
    under FSDP2 the fp32 shards are the masters (the blocks and the root all-gathered and computed in bf16,
    gradients reduced in fp32); otherwise ``ParallelModel.masters`` (a ``MasterWeights``) holds fp32 copies whose
    gradients accumulate in fp32 from every micro-batch and are reduced over the data-parallel ranks in fp32 (DDP's
    replicas then are kept by hand: parameters broadcast once, the masters' gradients all-reduced after the
    backward). ``read_model_grads``: where a step has one micro-batch and no data-parallel reduction, leave the bf16
    gradients on the parameters for an optimizer that reads them (megakern.optim.MasterAdamW).
    ``fp8``: a megakern.fp8 recipe: the blocks' linears (tensor-parallel ones too: their local GEMMs) compute in FP8;
    delayed scaling's amaxes are reduced (MAX) over every rank of the pipeline stage before the scales update
    (``update_fp8_scales``), so each rank scales as the single model would.
    ``compile``: torch.compile each block's forward (after tensor/context parallelism, before data parallelism); a
    string names the backend (default inductor).
    ``cuda_graph``: the training step will be captured in a CUDA graph; resolves tp_comm_overlap='auto' and
    tp_overlap_impl='auto' (``choose_tp_overlap``; ``ParallelModel.tp_overlap_note`` says what was chosen and why).
    """
    if isinstance(mesh, ParallelDims):
        mesh = mesh.build()
    if not isinstance(mesh, ParallelMesh):
        raise TypeError(f"parallelize: want a ParallelMesh (ParallelDims(...).build()) or ParallelDims, got "
                        f"{type(mesh).__name__}")
    if config is None:
        config = ParallelConfig()
    if not isinstance(config, ParallelConfig):
        raise TypeError(f"parallelize: config must be a megakern.config.ParallelConfig, got {type(config).__name__}")
    fields = {f.name for f in dataclasses.fields(ParallelConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(f"parallelize: unknown options {unknown}; ParallelConfig's fields are {sorted(fields)}")
    options = dataclasses.replace(config, **overrides)
    return ParallelModel(model, mesh, options, generator, rng, seed, master_weights=master_weights,
                         read_model_grads=read_model_grads, fp8=fp8, compile=compile, init_state=init_state,
                         cuda_graph=cuda_graph)


def choose_tp_overlap(overlap: bool | str, impl: str, tp: int, sequence_parallel: bool, cuda_graph: bool,
                      symmetric_problem: str, other_dims: str = "") -> tuple[bool, str, str]:
    """(overlap on, implementation, a sentence for the log: empty when nothing was chosen for the user) from
    ParallelConfig's tp_comm_overlap / tp_overlap_impl, resolving 'auto' by where the overlap measured faster
    (docs/results.md): through symmetric memory in CUDA-graph steps of tensor parallelism alone. Eager, the fused
    ops' host work outweighs what they hide, so auto leaves the overlap off there; beside other parallel dims
    (``other_dims``, e.g. 'dp=2', '' for none) it is not measured yet, and auto leaves it off too.
    ``symmetric_problem``: why symmetric memory cannot be used here ('' when it can)."""
    if impl == "auto":
        impl = "symmetric" if cuda_graph and not symmetric_problem else "ring"
    if overlap != "auto":
        return bool(overlap) and tp > 1, impl, ""
    if tp == 1:
        return False, impl, ""
    if not sequence_parallel:
        why = "off: sequence parallelism is off"
    elif not cuda_graph:
        why = "off: the step is eager (the overlap measured faster in CUDA-graph steps only)"
    elif other_dims:
        why = f"off: not yet measured beside {other_dims} (set parallel.tp_comm_overlap=true to try it)"
    elif not impl.startswith("symmetric"):
        why = ("off: " + (f"symmetric memory cannot be used ({symmetric_problem})" if symmetric_problem
                          else f"tp_overlap_impl={impl!r} did not measure faster"))
    else:
        return True, impl, f"tp_comm_overlap=auto: on, {impl} (a CUDA-graph step, NCCL ranks of one host)"
    return False, impl, f"tp_comm_overlap=auto: {why}"


class ParallelModel:
    """The local part of a parallel GPT and its training-step machinery (see the module docstring).

    Attributes: ``mesh`` (ParallelMesh), ``gpts`` (this rank's GPT chunks: one, or its pipeline stages),
    ``modules_chunks`` (the same, as wrapped for data parallelism), ``options``.
    """

    def __init__(self, model: nn.Module, pm: ParallelMesh, options: ParallelConfig, generator=None,
                 rng: RNGTracker | None = None, seed: int | None = None, *, master_weights: bool = False,
                 read_model_grads: bool = False, fp8=None, compile: bool | str = False,
                 init_state: dict | None = None, cuda_graph: bool = False):
        d = pm.dims
        cfg = getattr(model, "config", None)
        if cfg is None or not isinstance(getattr(model, "blocks", None), nn.ModuleDict):
            raise TypeError("parallelize: model must be a megakern.models.gpt.GPT (config, blocks ModuleDict)")
        self.mesh, self.options, self.config = pm, options, cfg
        self.tp, self.pp, self.cp, self.dp, self.ep = d.tp, d.pp, d.cp, d.dp, d.ep
        sp = options.sequence_parallel and d.tp > 1
        self.sequence_parallel = sp
        if options.tp_overlap_impl not in ("auto", "ring", *SYMMETRIC_IMPLS):
            raise ValueError(f"parallelize: tp_overlap_impl must be 'auto', 'ring', "
                             f"{', '.join(repr(i) for i in SYMMETRIC_IMPLS)}, got {options.tp_overlap_impl!r}")
        if options.tp_overlap_gather not in SYMMETRIC_GATHERS:
            raise ValueError(f"parallelize: tp_overlap_gather must be one of {', '.join(SYMMETRIC_GATHERS)}, got "
                             f"{options.tp_overlap_gather!r}")
        if not isinstance(options.tp_overlap_pieces, int) or not 1 <= options.tp_overlap_pieces <= SYMMETRIC_PIECES:
            raise ValueError(f"parallelize: tp_overlap_pieces must be an integer from 1 to {SYMMETRIC_PIECES}, got "
                             f"{options.tp_overlap_pieces!r}")
        if options.tp_overlap_signals not in SYMMETRIC_SIGNALS:
            raise ValueError(f"parallelize: tp_overlap_signals must be one of {', '.join(SYMMETRIC_SIGNALS)}, got "
                             f"{options.tp_overlap_signals!r}")
        if options.tp_comm_overlap not in ("auto", True, False):
            raise ValueError(f"parallelize: tp_comm_overlap must be true, false or 'auto', got "
                             f"{options.tp_comm_overlap!r}")
        symmetric_problem = symmetric_memory_usable(pm.tp_group, pm.device) if d.tp > 1 else ""
        other_dims = ", ".join(f"{k}={v}" for k, v in (("pp", d.pp), ("cp", d.cp), ("dp", d.dp), ("ep", d.ep))
                               if v > 1)
        overlap, overlap_impl, self.tp_overlap_note = choose_tp_overlap(
            options.tp_comm_overlap, options.tp_overlap_impl, d.tp, sp, cuda_graph, symmetric_problem, other_dims)
        self.tp_overlap = overlap_impl if overlap else None  # the implementation in use, None: no overlap
        if overlap and not sp:
            raise ValueError("parallelize: tp_comm_overlap overlaps the sequence-parallel reduce-scatter with the "
                             "matmul; it needs sequence_parallel=True")
        if options.dp_shard not in DP_SHARDS:
            raise ValueError(f"parallelize: dp_shard must be one of {DP_SHARDS}, got {options.dp_shard!r}")
        if options.fsdp_param_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"parallelize: fsdp_param_dtype must be 'float32' or 'bfloat16' (or 'auto'), got "
                             f"{options.fsdp_param_dtype!r}")
        if options.zero1 and options.dp_shard != "ddp":
            raise ValueError("parallelize: zero1 shards the optimizer of DDP; FSDP (dp_shard='fsdp') already shards "
                             "it: use dp_shard='ddp' with zero1, or zero1=False")
        if d.ep > 1 and options.zero1:
            raise ValueError(f"parallelize: ep={d.ep} with zero1: ZeRO-1 broadcasts each parameter from the dp x cp "
                             "rank that updates it, but each ep rank holds other experts; use zero1=False")
        spr = options.pp_stages_per_rank or (2 if options.pp_schedule == "interleaved-1f1b" and d.pp > 1 else 1)
        self.microbatches = options.microbatches or (d.pp if d.pp > 1 else 1)
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(f"parallelize: microbatches must be an int >= 1, got {self.microbatches!r}")
        if d.pp > 1:
            check_schedule(options.pp_schedule, d.pp, spr, self.microbatches)
        else:
            spr = 1
        # dropout: every draw of a forward inside the tracker's region: the residual stream is replicated over tp
        # ("replicated": one mask on all tp ranks) or, under sequence parallel, split over tp (a mask per tp rank)
        if rng is None:
            seed = seed if seed is not None else (
                generator.initial_seed() if generator is not None else 0)
            rng = RNGTracker.from_mesh(seed, pm)
        elif not isinstance(rng, RNGTracker):
            raise TypeError(f"parallelize: rng must be an RNGTracker, got {type(rng).__name__}")
        self.rng = rng
        self.dropout_region = "tensor_parallel" if sp else "replicated"
        n_experts = getattr(cfg, "n_experts", 0) or 0
        dense_mlps = not n_experts or len(cfg.moe_blocks) < cfg.n_layer  # MoE MLPs stay whole on each tp rank
        d.check_model(n_layer=cfg.n_layer, n_head=cfg.n_head, n_kv_head=cfg.n_kv_head, vocab=cfg.padded_vocab,
                      ffn_hidden=cfg.ffn_hidden if dense_mlps else None, stages_per_rank=spr, sequence_parallel=sp,
                      n_experts=n_experts)
        self.stages_per_rank = spr
        meta = any(p.is_meta for p in model.parameters())

        # 1. pipeline stages (GPT chunks holding their blocks)
        self.num_stages = d.pp * spr
        layout = stage_layout(cfg.n_layer, d.pp, spr, pm.pp_rank) if d.pp > 1 else [(0, range(cfg.n_layer))]
        self.stage_indices = [s for s, _ in layout]
        self.gpts, self.tied_copy = [], []
        for j, (stage, blocks) in enumerate(layout):
            if d.pp > 1:
                chunk, tied = cut_stage(model, stage, self.num_stages, blocks, reuse=j == len(layout) - 1)
            else:
                chunk, tied = model, False
            self.gpts.append(chunk)
            self.tied_copy.append(tied)
        self.has_first = 0 in self.stage_indices
        self.has_last = self.num_stages - 1 in self.stage_indices

        # 2. tensor (+ sequence) parallel, 3. context parallel
        # tp_comm_overlap (overlap.py): the row layers' GEMM + reduce-scatter as the ring ('ring'), or the row and
        # column layers' ops peer to peer through a symmetric-memory workspace ('symmetric': NCCL ranks of one host)
        self.tp_workspace = None
        gemm_reduce = gather_gemm = None
        if overlap:
            if overlap_impl in SYMMETRIC_IMPLS:
                if symmetric_problem:
                    raise ValueError(f"parallelize: tp_overlap_impl={overlap_impl!r} cannot run here: "
                                     f"{symmetric_problem}; use tp_overlap_impl='ring'")
                self.tp_workspace = SymmetricWorkspace(pm.tp_group, pm.device)
                self.tp_workspace.rs_impl = SYMMETRIC_IMPLS[overlap_impl]
                self.tp_workspace.gather = options.tp_overlap_gather
                self.tp_workspace.defer_joins = True  # every step ends in end_step, which joins them (flush)
                self.tp_workspace.rs_pieces = options.tp_overlap_pieces
                self.tp_workspace.signals = options.tp_overlap_signals
                gather_gemm = functools.partial(all_gather_gemm, workspace=self.tp_workspace)
            gemm_reduce = functools.partial(gemm_reduce_scatter, workspace=self.tp_workspace)
        self.tp_info = [apply_tensor_parallel(g, pm.tp_group if d.tp > 1 else None, sp, gemm_reduce=gemm_reduce,
                                              gather_gemm=gather_gemm)
                        for g in self.gpts]
        if d.cp > 1:
            for g in self.gpts:
                for block in g.blocks.values():
                    core = block.attn.core
                    block.attn.core = RingAttention(pm.cp_group, backend=getattr(core, "backend", None),
                                                    deterministic=getattr(core, "deterministic", True))
                    if getattr(block.mlp, "is_moe", False):  # it routes this rank's share of the sequence
                        block.mlp.shard_tokens(functools.partial(all_reduce, group=pm.cp_group), d.cp)
        # 3b. expert parallel: this rank's E / ep experts of each MoE layer, tokens dispatched by all-to-all
        self.expert_names = [apply_expert_parallel(g, pm.ep_group, d.ep, pm.ep_rank) if d.ep > 1 else []
                             for g in self.gpts]

        # 4. materialize: slices of a materialized model are copied already; a meta model is initialized here
        for g in self.gpts:
            if meta:
                g.to_empty(device=pm.device)
            else:
                g.to(pm.device)
        # the expert weights (E / ep experts each), reduced over the expert-data-parallel group (expert.py)
        self.expert_params = {p for g, names in zip(self.gpts, self.expert_names)
                              for name, p in g.named_parameters() if name in names}
        if init_state is not None and not meta:
            raise ValueError("parallelize: init_state is for a model on the meta device (a materialized model "
                             "already holds its weights)")
        if meta:
            if init_state is not None:
                self._load_weights(init_state)
            else:
                self._init_weights(type(model), generator)
            for g in self.gpts:  # persistent state that is not a parameter (MoE routers' balancing biases)
                if hasattr(g, "init_buffers"):
                    g.init_buffers()
        self.has_fp8 = fp8 is not None
        if fp8 is not None:  # the blocks' linears: nn.Linear, or a tensor-parallel layer's local GEMM
            from megakern import fp8 as fp8_ops

            for g in self.gpts:
                for block in g.blocks.values():
                    fp8_ops.convert_linears(block, recipe=fp8)
                    for layer in block.modules():
                        if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
                            layer.use_fp8(fp8)
            self.amax_group = pm.group("pp_stage") if d.world_size > d.pp else None
        if compile:  # each block's forward (hooks of data parallelism stay outside, eager)
            backend = compile if isinstance(compile, str) else "inductor"
            for g in self.gpts:
                for block in g.blocks.values():
                    block.forward = torch.compile(block.forward, backend=backend)

        # 5. data parallel over dp x cp
        # (torch 2.13's pipelining breaks DDP's bucket rebuild with several micro-batches, so under pipeline
        # parallelism "ddp" replicates by hand: parameters broadcast once, gradients all-reduced after the schedule)
        self.fsdp = options.dp_shard == "fsdp" and d.dp * d.cp > 1
        # bf16 weights with fp32 masters (not FSDP: there the fp32 shards are the masters): their gradients
        # accumulate in fp32 per micro-batch and are reduced in fp32, by hand (DDP would reduce the bf16 ones)
        self.masters = None
        if master_weights and not self.fsdp:
            direct = read_model_grads and self.microbatches == 1 and d.dp * d.cp == 1 and d.pp == 1
            self.masters = MasterWeights(self.parameters(), accumulate=not direct)
        self.ddp = options.dp_shard == "ddp" and d.dp * d.cp > 1 and d.pp == 1 and self.masters is None
        self.replicate = options.dp_shard == "ddp" and d.dp * d.cp > 1 and not self.ddp
        runners = ([PipelineChunk(g, functools.partial(self._dropout_rng, s))
                    for g, s in zip(self.gpts, self.stage_indices)] if d.pp > 1 else list(self.gpts))
        self.expert_mesh = None  # FSDP2 with ep > 1: the edp DeviceMesh the experts are sharded over
        if self.fsdp:
            param_dtype = {"float32": None, "auto": None, "bfloat16": torch.bfloat16}[options.fsdp_param_dtype]
            if master_weights:
                param_dtype = torch.bfloat16
            # expert parallelism: each MoE layer's experts an FSDP2 unit over their expert-data-parallel ranks, the
            # gradients summed there and divided by dp * cp (expert.py)
            self.expert_mesh = expert_data_mesh(pm) if d.ep > 1 else None
            for r, g in zip(runners, self.gpts):
                separate = expert_shards(g, self.expert_mesh, d.dp * d.cp) if d.ep > 1 else ()
                apply_fsdp(r, g.blocks.values(), pm.dp_cp_mesh, reshard_after_forward=d.pp == 1,
                           param_dtype=param_dtype, root_param_dtype=torch.bfloat16 if master_weights else None,
                           separate=separate)
            # fully_shard replaced the parameters with DTensors: the expert ones by name again
            self.expert_params = {p for g, names in zip(self.gpts, self.expert_names)
                                  for name, p in g.named_parameters() if name in names}
        elif self.ddp:
            for r, names in zip(runners, self.expert_names):
                if names:  # reduced over their expert-data-parallel group instead (finalize_grads)
                    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(r, names)
            runners = [apply_ddp(r, pm.dp_cp_group, pm.device) for r in runners]
        elif self.replicate:
            broadcast_params([p for p in self.parameters() if p not in self.expert_params], pm.dp_cp_group)
        # replicas of the same experts start alike (FSDP2 keeps shards of what every rank built alike, as for dense)
        if self.expert_params and pm.edp_group is not None and not self.fsdp:
            broadcast_params(self._expert_list(), pm.edp_group)
        self.modules_chunks = runners
        # FP8 under a pipeline: a new schedule's first step infers the stages' shapes with a forward (and backward) on
        # uninitialized buffers; the amaxes they record are dropped when the stage's first real forward starts
        self._shape_inference = {}
        self.has_moe = any(getattr(b.mlp, "is_moe", False) for g in self.gpts for b in g.blocks.values())
        if (self.has_fp8 or self.has_moe) and d.pp > 1:
            for r in runners:
                r.register_forward_pre_hook(self._after_shape_inference)

        # tied embeddings across the first and last pipeline stages: one group per (dp, cp, tp) coordinate
        self.tied_group = None
        if d.pp > 1 and cfg.tie_embeddings:
            for dp in range(d.dp):
                for c in range(d.cp):
                    for t in range(d.tp):
                        ranks = [d.rank_of(pp=0, dp=dp, cp=c, tp=t), d.rank_of(pp=d.pp - 1, dp=dp, cp=c, tp=t)]
                        group = dist.new_group(ranks)
                        if pm.rank in ranks:
                            self.tied_group = group
        self._schedules = {}
        self._ckpt_mesh = None
        self._checked_batch = False

    # ---- parameters ------------------------------------------------------------------------------------------------
    def named_parameters(self):
        """(name in the single model, parameter) of this rank (a tied head copy appears as lm_head.weight)."""
        for g in self.gpts:
            yield from g.named_parameters()

    def parameters(self):
        for _, p in self.named_parameters():
            yield p

    def _expert_list(self) -> list[torch.Tensor]:
        """This rank's expert weights (expert parallelism), in the chunks' order."""
        return [p for _, p in self.named_parameters() if p in self.expert_params]

    def _param_table(self):
        """[(name, param, tp dim or None, sp partial, tied copy)] over this rank's chunks."""
        rows = []
        for g, info, tied in zip(self.gpts, self.tp_info, self.tied_copy):
            for name, p in g.named_parameters():
                rows.append((name, p, info.shard_dims.get(name), name in info.sp_partial,
                             tied and name == "lm_head.weight"))
        return rows

    def train(self, mode: bool = True) -> ParallelModel:
        for m in self.modules_chunks:
            m.train(mode)
        return self

    def eval(self) -> ParallelModel:
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for m in self.modules_chunks:
            m.zero_grad(set_to_none=set_to_none)

    # ---- steps -----------------------------------------------------------------------------------------------------
    def _check_batch(self, idx, targets, packed: bool = False, microbatches: int | None = None) -> None:
        """``packed``: cu_seqlens is given; under context parallelism the documents are then padded into the THD
        layout (any sequence length)."""
        if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"ParallelModel: idx must be a (B, T) int64 tensor, got "
                             f"{getattr(idx, 'shape', type(idx).__name__)}")
        if not isinstance(targets, torch.Tensor) or targets.shape != idx.shape:
            raise ValueError(f"ParallelModel: targets must be shaped like idx {tuple(idx.shape)}, got "
                             f"{getattr(targets, 'shape', type(targets).__name__)}")
        b, t = idx.shape
        m = microbatches or self.microbatches
        if b % m:
            raise ValueError(f"ParallelModel: batch {b} is not divisible into {m} micro-batches")
        thd = packed and self.cp > 1  # cp_pack_layout pads every document and the local sequence instead
        if self.cp > 1 and not thd and t % (2 * self.cp):
            raise ValueError(f"ParallelModel: sequence length {t} is not divisible by 2*cp = {2 * self.cp}")
        if self.sequence_parallel and not thd and (t // self.cp) % self.tp:
            raise ValueError(f"ParallelModel: sequence parallel needs each cp rank's {t // self.cp} tokens "
                             f"divisible by tp={self.tp}")
        if not self._checked_batch and self.mesh.dims.world_size > 1:  # once: ranks of one dp index share a batch
            self._checked_batch = True
            weights = torch.arange(idx.numel(), device=idx.device).view_as(idx) % 65521 + 1
            mine = (self.mesh.dp_rank, int((idx.long() * weights).sum()), int((targets.long() * weights).sum()))
            seen = [None] * dist.get_world_size()
            dist.all_gather_object(seen, mine)
            bad = sorted({r for r, s in enumerate(seen) if s[0] == mine[0] and s[1:] != mine[1:]})
            if bad:
                raise RuntimeError(f"ParallelModel: ranks {bad} got a different batch than rank {self.mesh.rank} "
                                   f"(same data-parallel index {mine[0]}): every tp/cp/pp rank of a data-parallel "
                                   "replica must read the same batch (sampler rank = mesh.dp_rank)")

    def _global_tokens(self, targets) -> torch.Tensor:
        n = (targets != IGNORE_INDEX).sum().to(torch.float32)
        if self.dp > 1:
            dist.all_reduce(n, group=self.mesh.dp_group)
        return n

    def _positions(self, t: int):
        return cp_positions(t, self.cp, self.mesh.cp_rank, self.mesh.device) if self.cp > 1 else None

    def _local_sequence(self, x):
        return cp_shard(x, self.mesh.cp_group, 1) if self.cp > 1 else x

    def _dropout_rng(self, stage: int = 0):
        """The context a stage's forward runs in: the RNG tracker's dropout region (nothing without dropout, or in
        one process, whose dropout draws from the default generator)."""
        if not self.config.dropout or self.mesh.dims.world_size == 1:
            return contextlib.nullcontext()
        return self.rng.fork(self.dropout_region, stage)

    def _packed(self, cu_seqlens, max_seqlen, idx, microbatches: int | None = None) -> list:
        """Per micro-batch (cu_seqlens, max_seqlen) of a packed batch ((None, None): unpacked): host-side int32
        offsets re-based to 0 and the micro-batch's longest document. Checks that no document crosses a micro-batch
        boundary and that none is longer than the model's max_seqlen (one host read of cu_seqlens)."""
        m = microbatches or self.microbatches
        if cu_seqlens is None:
            if max_seqlen is not None:
                raise ValueError("ParallelModel: max_seqlen is given without cu_seqlens")
            return [(None, None)] * m
        b, t = idx.shape
        lengths = document_lengths("ParallelModel", cu_seqlens, b * t)  # 1-D int32, 0 .. B * T, non-decreasing
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        longest = max(lengths)
        if max_seqlen is not None and max_seqlen < longest:
            raise ValueError(f"ParallelModel: max_seqlen {max_seqlen} < the longest packed document ({longest})")
        per = b // m * t
        cuts = {j * per for j in range(m + 1)}
        if not cuts <= set(offsets):
            raise ValueError(f"ParallelModel: a packed document crosses a micro-batch boundary (offsets "
                             f"{sorted(cuts - set(offsets))} are not in cu_seqlens); pack each of the {m} "
                             "micro-batches on its own, or use microbatches=1")
        if longest > self.config.max_seqlen:
            raise ValueError(f"ParallelModel: a packed document has {longest} tokens; max_seqlen is "
                             f"{self.config.max_seqlen}")
        out = []
        for j in range(m):
            local = sorted({o - j * per for o in offsets if j * per <= o <= (j + 1) * per})
            longest_j = max((e - s for s, e in zip(local, local[1:])), default=0)
            out.append((torch.tensor(local, dtype=torch.int32), longest_j))
        return out

    def _loss_sum(self, module, idx, targets, pos, packed=(None, None), grad_scale=None):
        # the model reads no device value: the targets were checked once per batch (_check_values), the position
        # ids and packed offsets are this class's own. Under tensor parallelism the GPT's loss is the vocab-parallel
        # fused linear cross-entropy (tensor_parallel.py sets it): no (tokens x vocab/tp) fp32 logits.
        # ``grad_scale``: the gradient the sum's backward will receive (forward_backward's scale), which the fused
        # loss folds into the gradients it makes in the forward
        cu_seqlens, max_seqlen = packed
        extra = {} if grad_scale is None else {"grad_scale": grad_scale}
        with self._dropout_rng():
            return module(idx, targets, position_ids=pos, reduction="sum", cu_seqlens=cu_seqlens,
                          max_seqlen=max_seqlen, check_values=False, **extra)

    def _check_values(self, idx, targets) -> None:
        """Token ids and targets in range (targets may be ignore_index): one host read for the whole batch."""
        if not idx.numel():
            return
        vocab = self.config.vocab_size
        t_lo = torch.where(targets == IGNORE_INDEX, 0, targets).min()
        lims = torch.stack([idx.min(), idx.max(), t_lo, targets.max()]).tolist()
        if lims[0] < 0 or lims[1] >= vocab:
            raise ValueError(f"ParallelModel: token ids span {lims[0]}..{lims[1]}, outside the vocabulary "
                             f"[0, {vocab})")
        if lims[2] < 0 or lims[3] >= vocab:
            raise ValueError(f"ParallelModel: targets span {lims[2]}..{lims[3]} (besides ignore_index "
                             f"{IGNORE_INDEX}), outside the vocabulary [0, {vocab})")

    def forward_backward(self, idx: torch.Tensor, targets: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
                         max_seqlen: int | None = None, check_values: bool = True) -> torch.Tensor:
        """One step's forward and backward on this dp rank's batch (B, T); returns the global mean loss.

        ``cu_seqlens`` (ndocs + 1,) int32: packed documents, offsets into this rank's B * T flattened tokens (as
        GPT.forward takes them; under every layout; no document may cross a micro-batch boundary; under context
        parallelism each micro-batch is laid out in the THD layout, ``context.cp_pack_layout``); ``max_seqlen``
        their longest length (None: computed; the offsets are read on the host once per batch either way).
        ``check_values`` False: no host read of the token ids' and targets' range (one host-device sync per batch),
        for callers whose data pipeline checked them."""
        idx_l, tgt_l, pos, packed, n_global = self._prepare(idx, targets, cu_seqlens, max_seqlen, check_values)
        scale = self.dp * self.cp / n_global.clamp(min=1.0)
        if self.has_moe:
            # the MoE layers' aux losses: per micro-batch means (a cp rank's is its share of the micro-batch's), so
            # the step's is their mean over the dp x microbatches micro-batches: DDP's average over dp x cp does the
            # rest
            for g in self.gpts:
                g.set_aux_loss_scale(self.cp / self.microbatches)
        if self.masters is not None:
            self.masters.begin_step()
        if self.pp > 1:
            total = self._pipeline(idx_l, tgt_l, pos, scale, train=True, packed=packed)
        else:
            module = self.modules_chunks[0]
            total = torch.zeros((), dtype=torch.float32, device=self.mesh.device)
            m = self.microbatches
            for j, (x, t) in enumerate(zip(idx_l, tgt_l)):  # the micro-batches (_prepare)
                last = j == m - 1
                set_grad_sync(self.modules_chunks, last)
                with (module.no_sync() if self.ddp and not last else contextlib.nullcontext()):
                    with torch.profiler.record_function("forward"):  # ranges of a profile (torch.profiler)
                        s = self._loss_sum(module, x, t, pos[j], packed[j], grad_scale=scale)
                    with torch.profiler.record_function("backward"):
                        (s * scale).backward()  # s's gradient is scale, as announced
                total += s.detach().float()
        if self.masters is not None:
            self.masters.end_step()
        if self.tp_workspace is not None:
            self.tp_workspace.end_step()
        self.finalize_grads()
        return self._reduce_loss(total, n_global)

    @torch.no_grad()
    def eval_loss(self, idx: torch.Tensor, targets: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
                  max_seqlen: int | None = None, check_values: bool = True,
                  microbatches: int | None = None) -> torch.Tensor:
        """The global mean loss of a batch, without gradients (mode as set by train()/eval()); packed documents and
        ``check_values`` as in forward_backward. ``microbatches``: forwards the batch is cut into (default: the
        training's; under pipeline parallelism only those)."""
        if microbatches is not None and self.pp > 1 and microbatches != self.microbatches:
            raise ValueError(f"ParallelModel.eval_loss: the pipeline schedule runs {self.microbatches} micro-batches, "
                             f"not {microbatches}")
        idx_l, tgt_l, pos, packed, n_global = self._prepare(idx, targets, cu_seqlens, max_seqlen, check_values,
                                                            microbatches)
        if self.pp > 1:
            total = self._pipeline(idx_l, tgt_l, pos, None, train=False, packed=packed)
        else:
            total = sum(self._loss_sum(self.modules_chunks[0], x, t, p, k).float()
                        for x, t, p, k in zip(idx_l, tgt_l, pos, packed))
        if self.tp_workspace is not None:
            self.tp_workspace.end_step()
        return self._reduce_loss(total, n_global)

    def _prepare(self, idx, targets, cu_seqlens, max_seqlen, check_values: bool, microbatches: int | None = None):
        """A batch checked and laid out for this rank: (ids, targets, position ids (context parallel), packing per
        micro-batch ((cu_seqlens, max_seqlen), or (None, None)), the global count of targets that are not ignored).

        Under pipeline parallelism ids, targets and position ids are whole tensors the schedule splits into
        micro-batches, and the packing's offsets stay on the host (``packed_microbatches`` reads them); otherwise
        they are lists, one entry per micro-batch, the packing on the device. Packed documents under context
        parallelism: each micro-batch in the THD layout (``cp_pack_layout``), (1, L_j) ids, targets (pads ignored)
        and positions within the documents; under a pipeline every micro-batch padded to one length L, a multiple
        of 64 * lcm(2, tp under sequence parallel), so that few shapes (schedules) occur."""
        self._check_batch(idx, targets, packed=cu_seqlens is not None, microbatches=microbatches)
        if check_values:
            self._check_values(idx, targets)
        packed = self._packed(cu_seqlens, max_seqlen, idx, microbatches)  # host-side offsets
        device, m = self.mesh.device, microbatches or self.microbatches
        idx, targets = idx.to(device), targets.to(device)
        n_global = self._global_tokens(targets)  # the whole batch's (pads of the THD layout are ignored)
        if cu_seqlens is None or self.cp == 1:
            pos = self._positions(idx.shape[1])
            idx, targets = self._local_sequence(idx), self._local_sequence(targets)
            if self.pp > 1:
                return idx, targets, pos, packed, n_global
            packed = [(cu if cu is None else cu.to(device, non_blocking=True), n) for cu, n in packed]
            return list(idx.chunk(m)), list(targets.chunk(m)), [pos] * m, packed, n_global
        from megakern.parallel.context import cp_pack_layout

        mult = self.tp if self.sequence_parallel else 1  # the local tokens split over tp
        tokens = idx.numel() // m

        def layouts(length=None):
            return [cp_pack_layout(cu, tokens, self.cp, self.mesh.cp_rank, multiple=mult, length=length)
                    for cu, _ in packed]

        lays = layouts()
        if self.pp > 1:  # equal micro-batch shapes, bucketed
            step = math.lcm(2, mult) * 64
            lays = layouts(-(-max(lay.length for lay in lays) // step) * step)
        host = [(lay.cu_seqlens, lay.max_seqlen) for lay in lays]
        lays = [lay.to(device) for lay in lays]
        xs = [lay.shard(x).view(1, -1) for lay, x in zip(lays, idx.chunk(m))]
        ts = [lay.shard_targets(t).view(1, -1) for lay, t in zip(lays, targets.chunk(m))]
        pos = [lay.position_ids.view(1, -1) for lay in lays]
        if self.pp > 1:
            return torch.cat(xs), torch.cat(ts), torch.cat(pos), host, n_global
        return xs, ts, pos, [(lay.cu_seqlens, lay.max_seqlen) for lay in lays], n_global

    def _reduce_loss(self, total, n_global):
        total = total.detach().clone()
        if self.dp * self.cp > 1:
            dist.all_reduce(total, group=self.mesh.dp_cp_group)
        if self.pp > 1:  # the loss lives on the last stage
            dist.broadcast(total, src=dist.get_global_rank(self.mesh.pp_group, self.pp - 1), group=self.mesh.pp_group)
        # a batch whose targets are all ignored (an SFT batch of prompts alone) has loss 0, as its gradient
        return total / (n_global.clamp(min=1) if isinstance(n_global, torch.Tensor) else max(n_global, 1))

    def _pipeline(self, idx, targets, pos, scale, train: bool, packed=None):
        """``packed``: per micro-batch (host-side cu_seqlens, max_seqlen) or (None, None) (_prepare); packed
        micro-batches travel as the schedule's keyword arguments (every pp rank passes them), under context
        parallelism with their position ids (``pos`` (m, L))."""
        kwargs = {}
        if packed is not None and packed[0][0] is not None:
            from megakern.parallel.pipeline import packed_microbatches

            kwargs = packed_microbatches([cu for cu, _ in packed], position_ids=pos if self.cp > 1 else None,
                                         max_seqlen=max(n for _, n in packed), device=self.mesh.device)
            pos = None  # the chunks' attribute: the positions (if any) are the micro-batches' kwargs
        # the last stage takes its micro-batch's loss itself (the fused linear cross-entropy): the targets travel
        # with the micro-batches, and the schedule's loss only scales that sum
        kwargs["targets"] = targets.contiguous()
        key = (tuple(idx.shape), train, "cu_seqlens" in kwargs)
        if key not in self._schedules:  # one per batch shape and mode: stages size their buffers on first use
            self._schedules[key] = build_schedule(
                self.options.pp_schedule, self.modules_chunks, self.stage_indices, self.num_stages, self.mesh.device,
                self.mesh.pp_group, self.microbatches, lambda loss, t: self._loss_fn(loss, t))
            if self.has_fp8 or self.has_moe:  # its first step starts with the shape inference's forward on each stage
                self._shape_inference = {id(r): "inference" for r in self.modules_chunks}
        # the schedule also calls the loss on its first (shape-inference) pass: count only the returned losses
        self._loss_fn = (lambda loss, t: loss.sum() * scale) if train else (lambda loss, t: loss.sum())
        for chunk in self.modules_chunks:
            runner = chunk.module if isinstance(chunk, DistributedDataParallel) else chunk
            runner.position_ids = pos
        schedule = self._schedules[key]
        # contiguous: the stages check each micro-batch's strides against their first (torch 2.11 raises on a
        # (B, T) view of (B, T + 1) tokens)
        args = (idx.contiguous(),) if self.has_first else ()
        target = targets.contiguous() if self.has_last else None
        losses = [] if self.has_last else None
        if train:
            schedule.step(*args, target=target, losses=losses, **kwargs)
        else:
            schedule.eval(*args, target=target, losses=losses, **kwargs)
        if not losses:
            return torch.zeros((), dtype=torch.float32, device=self.mesh.device)
        total = torch.stack([l.detach().float() for l in losses]).sum()
        return total / scale if train else total

    def grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """The gradient of parameter ``p`` the step uses: its fp32 master's (``master_weights``), or its own (the
        local tensor of an FSDP2 shard's)."""
        g = self.masters.grad(p) if self.masters is not None else p.grad
        return g.to_local() if g is not None and hasattr(g, "to_local") else g

    def optimizer_params(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """What an optimizer over ``params`` (this rank's parameters) updates: their fp32 masters, or themselves."""
        return [self.masters.masters[p] for p in params] if self.masters is not None else list(params)

    def finalize_grads(self) -> None:
        """After the backward: average gradients over dp x cp where no wrapper did (replicated pipeline stages),
        all-reduce over tp the gradients that are partial there (sequence parallel), and sum a tied head's gradient
        with wte's across the first and last pipeline stages. (forward_backward calls it.)"""
        if self.replicate:
            grads = [g for g in map(self.grad, [p for p in dict.fromkeys(self.parameters())
                                                if p not in self.expert_params]) if g is not None]
            allreduce_tensors(grads, self.mesh.dp_cp_group, average=True)
        if self.expert_params and not self.fsdp:  # every rank of the group reduces all of them, a gradient or zeros
            grads = []
            for p in self._expert_list():
                if self.grad(p) is None:
                    p.grad = torch.zeros_like(p)
                grads.append(self.grad(p))
            reduce_expert_grads(grads, self.mesh.edp_group, self.dp * self.cp)
        partial, tied = [], []
        for name, p, _, sp_partial, tied_copy in self._param_table():
            g = self.grad(p)
            if g is None:
                continue
            if sp_partial:
                partial.append(g)
            if self.tied_group is not None and (tied_copy or (name == "wte.weight" and self.has_first)):
                tied.append(g)
        for grads, group in ((partial, self.mesh.tp_group if self.tp > 1 else None), (tied, self.tied_group)):
            if group is not None and grads:
                allreduce_tensors(grads, group)

    def grad_norm(self, norm_type: float = 2.0, sum_of_squares=None) -> torch.Tensor:
        """The total norm of the step's gradients (``grad``) over every group: the single model's gradient norm,
        equal on all ranks (fp32 0-d tensor on this rank's device). ``sum_of_squares``: see
        ``megakern.parallel.clip.grad_norm``."""
        pm = self.mesh
        sharded, replicated, experts = [], [], []
        for _, p, tp_dim, _, tied_copy in self._param_table():
            if tied_copy:
                continue  # its twin, wte on the first stage, is counted
            if p in self.expert_params:  # whole over tp, disjoint over ep, replicas over edp
                experts.append(self.grad(p))
            else:
                (sharded if tp_dim is not None else replicated).append(self.grad(p))
        dp = pm.dp_cp_group if self.fsdp else None
        pp = pm.pp_group if self.pp > 1 else None
        tp = pm.tp_group if self.tp > 1 else None
        sets = [(sharded, [tp, dp, pp]), (replicated, [dp, pp])]
        if self.ep > 1:  # FSDP2 shards them over edp (None: one rank)
            sets.append((experts, [pm.edp_group if self.fsdp else None, pm.ep_group, pp]))
        return grad_norm(sets, norm_type, device=pm.device, sum_of_squares=sum_of_squares)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False):
        """Clip all gradients by their total norm over every group; returns the norm (equal on all ranks)."""
        if not (isinstance(max_norm, (int, float)) and max_norm > 0):
            raise ValueError(f"clip_grad_norm_: max_norm must be a number > 0, got {max_norm!r}")
        norm = self.grad_norm(norm_type)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"clip_grad_norm_: the total gradient norm is {norm.item()}; pass "
                               "error_if_nonfinite=False to clip anyway")
        if max_norm != math.inf:
            self.scale_grads_(clip_coefficient(norm, max_norm))
        return norm

    @torch.no_grad()
    def scale_grads_(self, factor: torch.Tensor | float) -> None:
        """Every gradient the step uses (``grad``) times ``factor`` (a 0-d tensor or a number), in place."""
        grads = [g for g in map(self.grad, dict.fromkeys(self.parameters())) if g is not None]
        if grads:
            torch._foreach_mul_(grads, factor.to(grads[0].device) if isinstance(factor, torch.Tensor) else factor)

    def build_optimizer(self, optimizer_class=torch.optim.AdamW, params=None, **kwargs):
        """``optimizer_class`` over this rank's parameters (or ``params``: tensors or param-group dicts; with
        ``master_weights`` their fp32 masters take their places); a ZeroRedundancyOptimizer over dp x cp when the plan
        has zero1."""
        params = list(self.parameters()) if params is None else params
        if self.masters is not None:
            params = [dict(g, params=self.optimizer_params(g["params"])) if isinstance(g, dict)
                      else self.masters.masters[g] for g in params]
        if self.options.zero1 and self.dp * self.cp > 1:
            return zero1_optimizer(params, optimizer_class, self.mesh.dp_cp_group, **kwargs)
        return optimizer_class(params, **kwargs)

    @torch.no_grad()
    def _after_shape_inference(self, module, args) -> None:
        """A pipeline stage's forward pre-hook (FP8 only): the forward after a new schedule's shape inference drops
        the amaxes the inference recorded on uninitialized buffers (forward and backward) from the stage's FP8
        layers."""
        state = self._shape_inference.get(id(module))
        if state == "inference":
            self._shape_inference[id(module)] = "real"
        elif state == "real":
            del self._shape_inference[id(module)]
            if self.has_fp8:
                from megakern import fp8 as fp8_ops

                fp8_ops.discard_pending(module)
            if self.has_moe:  # the MoE statistics the inference's backward added
                module.gpt.discard_moe_statistics()

    @torch.no_grad()
    def update_fp8_scales(self) -> torch.Tensor:
        """Once per optimizer step with ``fp8``: delayed scaling's pending amaxes reduced (MAX) over the ranks of
        this pipeline stage (tensor shards and data-parallel replicas see parts of what the single model's tensor
        holds), then every layer's scales updated (megakern.fp8.update_scales). Returns the device bool: an amax of
        the step was not finite on some rank (every rank then skips the step alike)."""
        from megakern import fp8 as fp8_ops

        if self.amax_group is not None:
            buffers = [b for g in self.gpts for b in fp8_ops.pending_amaxes(g)]
            if buffers:
                flat = torch.cat([b.reshape(-1) for b in buffers]).nan_to_num(nan=math.inf)
                dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=self.amax_group)
                torch._foreach_copy_([b.reshape(-1) for b in buffers], list(flat.split([b.numel() for b in buffers])))
        bad = torch.stack([fp8_ops.update_scales(g).to(self.mesh.device) for g in self.gpts]).any()
        if self.pp > 1:  # every stage skips the step alike
            flag = bad.float()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.mesh.pp_group)
            bad = flag > 0
        return bad

    # ---- checkpoints -----------------------------------------------------------------------------------------------
    def checkpoint_state(self, optimizer=None, *, for_load: bool = False) -> dict:
        """{"model": {fqn: DTensor}, "optim": {...}, "master": {fqn: fp32 master} (``master_weights``), "buffers":
        {...} (FP8 scaling state)} for torch.distributed.checkpoint (save or load), in the single model's names and
        shapes, so it loads under any other layout (one process: plain tensors). ``for_load``: first give every
        parameter its optimizer state so that DCP can load into it."""
        if self.mesh.local:
            def whole(t, tp_dim, expert=False):
                return t
        else:
            if self._ckpt_mesh is None:
                self._ckpt_mesh = checkpoint_mesh(self.mesh)
                if self.ep > 1:
                    self._expert_ckpt_mesh = expert_checkpoint_mesh(self.mesh)

            def whole(t, tp_dim, expert=False):
                if expert:  # this rank's E / ep experts: dim-0 shards of the (E, ...) tensor over ep
                    return as_global_expert(t, self._expert_ckpt_mesh, self.ep)
                return as_global(t, tp_dim, self.tp, self._ckpt_mesh)
        table = self._param_table()
        model, names, master = {}, {}, {}
        for name, p, tp_dim, _, tied_copy in table:
            key = "wte.weight" if tied_copy else name
            expert = p in self.expert_params
            names[p] = (key, tp_dim, expert)
            model[key] = whole(p.detach(), tp_dim, expert)
            if self.masters is not None:
                m = self.masters.masters[p]
                names[m] = (key, tp_dim, expert)
                master[key] = whole(m.detach(), tp_dim, expert)
        state = {"model": model}
        if master:
            state["master"] = master
        params = {p for _, p, *_ in table}
        buffers = {}
        for g in self.gpts:  # persistent buffers (FP8 scaling), replicated over the stage's ranks
            for key, b in g.state_dict(keep_vars=True).items():
                if isinstance(b, torch.Tensor) and b not in params and not isinstance(b, nn.Parameter):
                    buffers[key.replace(".fp8_gemm.", ".")] = whole(b.detach(), None)
        if buffers:
            state["buffers"] = buffers
        if optimizer is not None:
            inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: this rank's share
            if for_load:
                init_optimizer_state(optimizer, self.optimizer_params([p for _, p, *_ in table]))
            opt_state = {}
            for p, s in inner.state.items():
                if p not in names:
                    continue
                key, tp_dim, expert = names[p]
                opt_state[key] = {k: (whole(v.detach(), tp_dim, expert)
                                      if isinstance(v, torch.Tensor) and v.shape == p.shape and v.dim() > 0 else v)
                                  for k, v in s.items()}
            state["optim"] = {"state": opt_state, "param_groups": group_hparams(optimizer)}
        return state

    def load_checkpoint_state(self, state: dict, optimizer=None) -> None:
        """After ``dcp.load(state)`` into ``checkpoint_state(optimizer, for_load=True)``: tensors were loaded in
        place; this restores the optimizer's hyper-parameters (learning rate, ...) per param group."""
        if optimizer is None or "optim" not in state:
            return
        saved = state["optim"]["param_groups"]
        if len(saved) != len(optimizer.param_groups):
            raise ValueError(f"load_checkpoint_state: the checkpoint has {len(saved)} param groups, the optimizer "
                             f"{len(optimizer.param_groups)}")
        for group, hp in zip(optimizer.param_groups, saved):
            group.update({k: v for k, v in hp.items() if k != "params"})

    # ---- initialization --------------------------------------------------------------------------------------------
    def _slices(self):
        """(name in the single model, local parameter, split dim or None, this rank's index, parts) per parameter."""
        for name, p, tp_dim, _, tied_copy in self._param_table():
            split, index, parts = tp_dim, self.mesh.tp_rank, self.tp
            if p in self.expert_params:  # this rank's E / ep experts
                split, index, parts = 0, self.mesh.ep_rank, self.ep
            yield ("wte.weight" if tied_copy else name), p, split, index, parts

    @torch.no_grad()
    def _load_weights(self, state: dict) -> None:
        """Every local shard from the whole model's tensors in ``state`` (checked: names and full shapes)."""
        missing = []
        for name, p, split, index, parts in self._slices():
            if name not in state:
                missing.append(name)
                continue
            full = state[name]
            shape = list(p.shape)
            if split is not None:
                shape[split] *= parts
            if tuple(full.shape) != tuple(shape):
                raise ValueError(f"parallelize: init_state[{name!r}] has shape {tuple(full.shape)}, the model's is "
                                 f"{tuple(shape)}")
            n = p.shape[split] if split is not None else None
            p.copy_(full.narrow(split, index * n, n) if split is not None else full)
        if missing:
            raise ValueError(f"parallelize: init_state lacks {missing[:6]}{' ...' if len(missing) > 6 else ''}")

    def _init_weights(self, gpt_class, generator) -> None:
        """Initialize every local shard as the single model's init_weights initializes the whole tensor: the full
        tensor of each parameter is drawn (one at a time) by the model's own rule and this rank's slice kept."""
        config = self.config

        class FullShapes:  # what GPT.init_weights reads: config and named_parameters()
            pass

        shim = FullShapes()
        shim.config = config

        def named_parameters():
            for name, p, split, index, parts in self._slices():
                shape = list(p.shape)
                if split is not None:
                    shape[split] *= parts
                full = torch.empty(shape, dtype=p.dtype, device=p.device)
                yield name, full
                with torch.no_grad():
                    n = p.shape[split] if split is not None else None
                    p.copy_(full.narrow(split, index * n, n) if split is not None else full)

        shim.named_parameters = named_parameters
        gpt_class.init_weights(shim, generator)
