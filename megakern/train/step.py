"""The training step: the model and its optimizer built for the run (TrainStep), and one optimizer step on them.

Every run takes the same path, one process or many: the GPT is built on the meta device and handed to
megakern.parallel's ``parallelize`` over the run's mesh (one process: a local mesh of ones, no process group), which
materializes it (whole, or this rank's shards), gives it its precision (bf16 weights with fp32 masters, FP8 linears),
compiles its blocks and wraps it for data parallelism. One step, with A = global_batch / (micro_batch x data-parallel
size) micro-batches on each rank:

    forward_backward(rank's step batch):  A micro-batches, each forward (loss summed over its tokens) -> backward of
                                          loss / N (N: the global batch's tokens), gradients accumulated (in fp32
                                          for bf16 weights) and reduced over the data-parallel ranks
    grad norm over every group (clipped to train.grad_clip) -> found_inf = loss or norm not finite (on the device)
    finite: AdamW step at the schedule's lr;  not finite: the step is skipped
    MoE layers: their statistics summed over the micro-batches and ranks, appended to the step's values, and the
                sigmoid routers' balancing biases updated from the step's loads (not when the step is skipped, nor
                when a router saw a non-finite logit, which skips the step: experts.py)

With a fused optimizer nothing is read on the host (``device_step``: the optimizer skips itself on the device), which
is what a CUDA-graph step captures (graph.py); other optimizers read the figures and skip on the host
(``host_step``).
"""
from __future__ import annotations

import contextlib

import torch

from megakern import _nvtx
from megakern.config import ConfigError, TrainConfig
from megakern.data import Batch, to_batch
from megakern.train.experts import MoEStats
from megakern.train.figures import StepFigures
from megakern.train.optimizer import device_skip, optimizer_impl, optimizer_kwargs, param_groups
from megakern.train.runtime import Dist, fp8_recipe


class TrainStep:
    """The model (this rank's ParallelModel ``pmodel``; ``model`` its first GPT chunk, the whole GPT in one process),
    its precision (bf16 weights with fp32 masters, or bf16 autocast, or fp32), its optimizer and one optimizer step
    on them.

    ``accum``: micro-batches a step on each data-parallel rank; ``microbatches``: how ``forward_backward`` cuts the
    rank's step batch (parallel.microbatches, default ``accum``). ``eod_id``: the end-of-document token when
    documents are packed (None: they are not).
    """

    def __init__(self, config: TrainConfig, *, device: torch.device, precision: str, env: Dist, accum: int,
                 microbatches: int, eod_id: int | None, generator: torch.Generator, log, profiling: bool = False):
        c, t = config, config.train
        self.config, self.device, self.precision, self.env, self.log = config, device, precision, env, log
        self.accum, self.microbatches, self.eod_id, self.profiling = accum, microbatches, eod_id, profiling
        self.draws = 1  # the rank's whole step batch, cut into micro-batches by forward_backward

        # model: built on the meta device, materialized once by parallelize (whole, or this rank's shards)
        from megakern.models.gpt import GPT
        from megakern.parallel import parallelize

        with torch.device("meta"):
            model = GPT(c.model)
        init_state = None
        if c.model.init_from is not None:  # the checkpoint's tensors, memory-mapped: each rank reads its slices,
            from megakern.models import hf    # one block made at a time

            try:
                init_state, _ = hf.read_state(c.model.init_from.removeprefix("hf:"), lazy=True)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"model.init_from: {exc}") from None
            log(f"model: initialized from {c.model.init_from} ({len(init_state)} tensors)")
        self.n_params, self.n_body = model.num_params(), model.num_params(exclude_embeddings=True)
        self.n_active = model.num_params(active=True)
        self.flops_per_token_fn = model.flops_per_token
        # the stream a CUDA-graph step is captured on; DDP is built on it (it keeps the parameters' autograd
        # accumulator nodes, which record the stream they were made on: another stream would join the capture)
        self.capture_stream = (torch.cuda.Stream(device) if t.cuda_graph and device.type == "cuda" else None)
        p = c.parallel
        world = env.mesh.dims
        sharded = (p.dp_shard == "fsdp" and world.dp * world.cp > 1) or (p.zero1 and world.dp * world.cp > 1)
        self.optim_impl = optimizer_impl(c.optim, device, precision, sharded)
        fsdp_dtype = p.fsdp_param_dtype
        if fsdp_dtype == "auto":
            fsdp_dtype = "bfloat16" if precision == "bf16-autocast" else "float32"
        try:
            with (torch.cuda.stream(self.capture_stream) if self.capture_stream is not None
                  else contextlib.nullcontext()):
                self.pmodel = parallelize(model, env.mesh, p, generator=generator, microbatches=microbatches,
                                          fsdp_param_dtype=fsdp_dtype, master_weights=precision == "bf16",
                                          read_model_grads=self.optim_impl == "megakern",
                                          fp8=fp8_recipe(t.fp8) if t.fp8 != "none" else None, compile=t.compile,
                                          init_state=init_state,
                                          cuda_graph=bool(t.cuda_graph) and device.type == "cuda")
            del init_state
            if self.capture_stream is not None:
                torch.cuda.current_stream(device).wait_stream(self.capture_stream)
        except ValueError as exc:
            raise ConfigError(f"parallel: {exc}") from None
        if self.pmodel.tp_overlap_note:
            log(f"parallel: {self.pmodel.tp_overlap_note}")
        if self.pmodel.fsdp:
            dtype = "bfloat16" if precision == "bf16" else fsdp_dtype
            if dtype != "float32":
                log(f"FSDP2: parameters all-gathered and computed in {dtype}, fp32 shards updated (the master "
                    "weights), gradients reduced in fp32")
        self.model = self.pmodel.gpts[0]
        self.has_fp8 = self.pmodel.has_fp8
        self.moe = MoEStats(self.pmodel, device) if c.model.n_experts else None
        self.masters = self.pmodel.masters.masters if self.pmodel.masters is not None else None

        # the optimizer: AdamW groups (decay / no decay) over the parameters, whose fp32 masters take their places
        named = list(self.pmodel.named_parameters())
        groups = param_groups(named, c.optim, tied=c.model.tie_embeddings)
        self.names = {}
        for name, param in named:
            self.names.setdefault(param, name)
        self.opt_names = dict(self.names)
        if self.masters is not None:
            self.opt_names.update({m: self.names[param] for param, m in self.masters.items()})
        # (a CUDA graph cannot keep autocast's cache of casts between captures: it is off there)
        self.autocast = (torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=not t.cuda_graph)
                         if precision == "bf16-autocast" else contextlib.nullcontext())
        kwargs = optimizer_kwargs(c.optim, self.optim_impl)
        if t.cuda_graph:  # the step and the learning rate on the device (one tensor, every group), read by the graph
            kwargs.update(capturable=True, lr=torch.tensor(float(kwargs["lr"]), device=device))
        self.optimizer = self.pmodel.build_optimizer(torch.optim.AdamW, params=groups, **kwargs)
        # a non-finite step is skipped by the fused optimizer on the device (no sync), else on the host (over
        # several ranks too: loss and norm are reduced over every group, so all ranks skip alike)
        self.device_skip = device_skip(self.optimizer)
        # bf16 weights: one pass updates the masters and writes the weights (megakern.optim; it reads the bf16
        # gradients themselves when a step has one micro-batch and no data-parallel reduction)
        self.master_step = None
        if self.optim_impl == "megakern":
            from megakern.optim import MasterAdamW

            self.master_step = MasterAdamW(self.optimizer, {m: param for param, m in self.masters.items()})
        # the clipping norm's sum of squares in one Triton launch per dtype, beside megakern's optimizer
        self.sum_of_squares = None
        if self.optim_impl == "megakern":
            from megakern.optim import SumOfSquares

            self.sum_of_squares = SumOfSquares()
        self.clip_divisor = None  # the fused optimizer's grad_scale when it does the clipping (figures)

    def flops_per_token(self, seq_length: int) -> float:
        """Model FLOPs per trained token at ``seq_length`` (forward and backward)."""
        return self.flops_per_token_fn(seq_length)

    # -- running the step -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def range(self, name: str):
        """An NVTX range (for Nsight Systems) and, when profiling, a torch.profiler range."""
        with _nvtx.annotate(f"train.{name}"):
            if self.profiling:
                with torch.profiler.record_function(name):
                    yield
            else:
                yield

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next step (in place in device memory where a CUDA-graph step reads it)."""
        for g in self.optimizer.param_groups:
            if isinstance(g["lr"], torch.Tensor):
                g["lr"].fill_(lr)
            else:
                g["lr"] = lr

    def set_training(self, mode: bool) -> None:
        self.pmodel.train(mode)

    def run(self, samples: list[dict], number: int) -> StepFigures:
        """Step ``number`` (1-based) on ``samples`` (the rank's step batch, one draw of the data loader), queued: its
        figures, read on the host by ``.read()``."""
        figures = self.figures([self.to_device(s) for s in samples])
        if self.device_skip:
            return self.to_host(self.device_step(figures), number)
        return self.host_step(figures, number)

    def to_device(self, sample: dict) -> Batch:
        with self.range("data"):
            return to_batch(sample, self.device, self.eod_id)

    def figures(self, batches: list[Batch]) -> list[torch.Tensor]:
        """Forward and backward of the rank's step batch (``batches[0]``, which forward_backward cuts into
        micro-batches) and the clipping: [mean loss, norm (, FP8's non-finite flag)] on the device."""
        clip, batch = self.config.train.grad_clip, batches[0]
        if self.moe is not None:
            self.moe.begin()
        with self.range("forward_backward"), self.autocast:
            loss = self.pmodel.forward_backward(batch.inputs, batch.targets, **batch.parallel_kwargs(),
                                                check_values=False)
        if self.moe is not None:
            self.moe.reduce()
        with self.range("optimizer"):
            norm = self.pmodel.grad_norm(sum_of_squares=self.sum_of_squares)
            self.clip_divisor = None
            if clip > 0:
                if self.device_skip:
                    # the fused optimizer divides the gradients by its grad_scale as it reads them: clipping rides
                    # in the update instead of a pass over every gradient (the clipping coefficient, as a divisor)
                    self.clip_divisor = torch.clamp((norm + 1e-6) / clip, min=1.0)
                else:
                    self.pmodel.scale_grads_(torch.clamp(clip / (norm + 1e-6), max=1.0))
            figures = [loss.float(), norm.float()]
            if self.has_fp8:
                figures.append(self.pmodel.update_fp8_scales().to(self.device, torch.float32))
            return figures

    @torch.no_grad()
    def copy_masters(self) -> None:
        """bf16 parameters <- their fp32 master weights (round to nearest even)."""
        if self.masters is not None:
            self.pmodel.masters.copy_to_model()

    def host_step(self, figures: list[torch.Tensor], number: int) -> StepFigures:
        """The optimizer step after reading the figures on the host (a sync), skipped if loss or norm is not finite
        (or the FP8 flag, a third figure, is set)."""
        values = self.step_values(figures)
        self.after_values(values)
        result = StepFigures(number, values.cpu())
        if result.read()[2]:
            self._optimizer_step()
            self.copy_masters()
        if self.masters is None:  # the masters' gradients are overwritten by the next step's first micro-batch
            self.optimizer.zero_grad(set_to_none=True)
        return result

    def step_values(self, figures: list[torch.Tensor]) -> torch.Tensor:
        """(loss, norm, 1.0 if the step must be skipped) as one fp32 device tensor, then the MoE layers' figures
        (experts.MoEStats.figures) when the model has experts."""
        loss, norm = (f.to(self.device, torch.float32).reshape(()) for f in figures[:2])
        bad = ~(torch.isfinite(loss) & torch.isfinite(norm))
        if len(figures) > 2:
            bad = bad | (figures[2].to(self.device).reshape(()) != 0)
        if self.moe is None:
            return torch.stack([loss, norm, bad.to(torch.float32)])
        bad = bad | self.moe.nonfinite()
        return torch.cat([torch.stack([loss, norm, bad.to(torch.float32)]), self.moe.figures()])

    def after_values(self, values: torch.Tensor) -> None:
        """Once per optimizer step, on the device: the sigmoid routers' biases from the step's loads, unless the step
        is skipped (``values[2]``)."""
        if self.moe is not None:
            self.moe.update_bias(values[2] != 0)

    def device_step(self, figures: list[torch.Tensor]) -> torch.Tensor:
        """The fused optimizer's step, which skips itself on the device when the step is bad; nothing is read on
        the host (this is what a CUDA-graph step captures). Returns the step's values."""
        values = self.step_values(figures)
        self.after_values(values)
        if self.master_step is not None:  # masters, moments and bf16 weights in one pass; skipped on values[2]
            self.master_step.step(grad_scale=self.clip_divisor, found_inf=values[2])
            for p in self.masters:
                p.grad = None
            return values
        # 0-d fp32 device tensors: the clipping divisor (see figures) and the skip flag
        self.optimizer.grad_scale, self.optimizer.found_inf = self.clip_divisor, values[2]
        try:
            self._optimizer_step()
        finally:
            self.optimizer.grad_scale = self.optimizer.found_inf = None
        if self.masters is not None:  # after a skipped step the masters are unchanged: an exact no-op
            self.copy_masters()
        else:  # the masters' gradients are overwritten by the next step's first micro-batch
            self.optimizer.zero_grad(set_to_none=True)
        return values

    def after_capture(self) -> None:
        """After a CUDA graph captured ``device_step``: megakern's master step and sum of squares write the pointer
        tables they built during the capture, before the first replay."""
        if self.master_step is not None:
            self.master_step.flush()
        if self.sum_of_squares is not None:
            self.sum_of_squares.flush()

    def _optimizer_step(self) -> None:
        """optimizer.step(); over FSDP2's DTensor shards it runs on their local tensors (the same update, without
        DTensor's per-call dispatch: see megakern.parallel.data_parallel.local_shards)."""
        if self.pmodel.fsdp:
            from megakern.parallel.data_parallel import local_shards

            with local_shards(self.optimizer):
                self.optimizer.step()
        else:
            self.optimizer.step()

    def to_host(self, values: torch.Tensor, number: int) -> StepFigures:
        """Step ``number``'s figures copied to the host without waiting: into pinned memory behind an event on
        CUDA."""
        if values.device.type != "cuda":
            return StepFigures(number, values.cpu())
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return StepFigures(number, host, event)

    @torch.no_grad()
    def eval_loss(self, batch: Batch) -> torch.Tensor:
        """The mean loss of one held-out batch (over the ranks' shards), no gradients."""
        with self.autocast:
            return self.pmodel.eval_loss(batch.inputs, batch.targets, **batch.parallel_kwargs(), check_values=False,
                                         microbatches=None if self.pmodel.pp > 1 else 1).float()
