"""megakern.parallel: tensor, sequence, pipeline, data, context and expert parallelism on torch.distributed.

Installed as ``megakern.parallel`` (the source folder is parallel/). Process groups and layouts are passed
explicitly; nothing here holds module-level state.

    dims = ParallelDims(tp=2, pp=2, cp=1)                  # dp = world // (tp * pp * cp)
    pm = dims.build("cuda", timeout=600, agree={"config": cfg})
    pmodel = parallelize(model, pm, cfg.parallel)          # -> ParallelModel
    loss = pmodel.forward_backward(idx, targets)           # this dp rank's batch; the global mean loss
    pmodel.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()

    with StepWatchdog(pm, timeout_s=300, log=log) as watchdog:   # a hung or dead rank named, every rank ended
        for step in ...: watchdog.begin_step(step); ...; watchdog.end_step(step)
"""
from megakern.parallel.clip import clip_grad_norm_
from megakern.parallel.context import RingAttention, cp_positions, cp_shard, cp_unshard, ring_attention
from megakern.parallel.cross_entropy import vocab_parallel_cross_entropy
from megakern.parallel.dims import (MESH_DIMS, DisagreementError, ParallelDims, ParallelMesh, Rendezvous,
                                    RendezvousError, check_agreement, config_hash, init_distributed, versions)
from megakern.parallel.expert import ExpertDispatcher, all_to_all, apply_expert_parallel
from megakern.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, linear_reduce
from megakern.parallel.overlap import all_gather_gemm, gemm_reduce_scatter
from megakern.parallel.parallelize import ParallelModel, parallelize
from megakern.parallel.pipeline import PipelineChunk, cut_stage, stage_layout
from megakern.parallel.rng import RNGTracker, region_seed
from megakern.parallel.symmetric import SymmetricWorkspace
from megakern.parallel.tensor_parallel import TPInfo, apply_tensor_parallel
from megakern.parallel.watchdog import EXIT_CODE as WATCHDOG_EXIT_CODE
from megakern.parallel.watchdog import StepWatchdog, WatchdogError
from megakern.parallel.mappings import (copy_to_tp, gather_from_sp, gather_from_tp, reduce_from_tp,
                                        reduce_scatter_to_sp, scatter_to_sp, scatter_to_tp, token_shard)

__all__ = [
    "MESH_DIMS", "ColumnParallelLinear", "DisagreementError", "ExpertDispatcher", "ParallelDims", "ParallelMesh",
    "ParallelModel", "PipelineChunk", "RNGTracker", "Rendezvous", "RendezvousError", "RingAttention",
    "RowParallelLinear", "StepWatchdog", "SymmetricWorkspace", "TPInfo", "VocabParallelEmbedding",
    "WATCHDOG_EXIT_CODE", "WatchdogError",
    "all_gather_gemm", "all_to_all", "apply_expert_parallel", "apply_tensor_parallel", "check_agreement",
    "clip_grad_norm_", "config_hash", "cut_stage", "gemm_reduce_scatter", "parallelize", "stage_layout",
    "copy_to_tp", "cp_positions", "cp_shard", "cp_unshard", "gather_from_sp", "gather_from_tp", "init_distributed",
    "linear_reduce", "reduce_from_tp", "reduce_scatter_to_sp", "region_seed", "ring_attention", "scatter_to_sp",
    "scatter_to_tp", "token_shard",
    "versions", "vocab_parallel_cross_entropy",
]
