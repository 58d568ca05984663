"""The training step: the model and its optimizer built for the run (TrainStep), and one optimizer step on them.

One step, with A = global_batch / (micro_batch x data-parallel size) micro-batches on each rank:

    for each of A micro-batches:   forward (loss, mean over its tokens) -> backward of loss / A
    grad norm (clipped to train.grad_clip) -> found_inf = loss or norm not finite (on the device)
    finite: AdamW step at the schedule's lr;  not finite: the step is skipped

In one process the micro-batches are drawn one by one; over several ranks (megakern.parallel's ParallelModel) a rank
draws its whole step batch and ``forward_backward`` cuts it into parallel.microbatches. With a fused optimizer nothing
is read on the host (``device_step``: the optimizer skips itself on the device), which is what a CUDA-graph step
captures (graph.py); other optimizers read the figures and skip on the host (``host_step``).
"""
from __future__ import annotations

import contextlib
import math

import torch

from megakern import _nvtx
from megakern.config import ConfigError, TrainConfig
from megakern.data import Batch, to_batch
from megakern.train.figures import StepFigures
from megakern.train.optimizer import device_skip, optimizer_impl, optimizer_kwargs, param_groups
from megakern.train.runtime import Dist, fp8_recipe


class TrainStep:
    """The model (a GPT, or this rank's ParallelModel), its precision (bf16 weights with fp32 ``masters``, or bf16
    autocast, or fp32), its optimizer and one optimizer step on them.

    ``accum``: micro-batches a step on each data-parallel rank; ``microbatches``: how a parallel run's
    ``forward_backward`` cuts the rank's step batch (1 in one process); ``draws``: draws of the data loader a step
    (each micro-batch in one process, the rank's whole step batch over several ranks). ``eod_id``: the
    end-of-document token when documents are packed (None: they are not).
    """

    def __init__(self, config: TrainConfig, *, device: torch.device, precision: str, env: Dist, accum: int,
                 microbatches: int, eod_id: int | None, generator: torch.Generator, log, profiling: bool = False):
        c, t = config, config.train
        self.config, self.device, self.precision, self.env, self.log = config, device, precision, env, log
        self.accum, self.microbatches, self.eod_id, self.profiling = accum, microbatches, eod_id, profiling
        self.parallel = env.mesh is not None
        self.draws = 1 if self.parallel else accum

        # model: built on the meta device, materialized once (whole, or this rank's shards), seeded init
        from megakern.models.gpt import GPT

        with torch.device("meta"):
            model = GPT(c.model)
        self.n_params, self.n_body = model.num_params(), model.num_params(exclude_embeddings=True)
        self.flops_per_token_fn = model.flops_per_token
        # the stream a CUDA-graph step is captured on; DDP is built on it (it keeps the parameters' autograd
        # accumulator nodes, which record the stream they were made on: another stream would join the capture)
        self.capture_stream = (torch.cuda.Stream(device) if t.cuda_graph and device.type == "cuda" else None)
        if self.parallel:
            from megakern.parallel import parallelize

            try:
                fsdp_dtype = c.parallel.fsdp_param_dtype
                if fsdp_dtype == "auto":
                    fsdp_dtype = "bfloat16" if precision == "bf16-autocast" else "float32"
                with (torch.cuda.stream(self.capture_stream) if self.capture_stream is not None
                      else contextlib.nullcontext()):
                    self.pmodel = parallelize(model, env.mesh, c.parallel, generator=generator,
                                              microbatches=microbatches, fsdp_param_dtype=fsdp_dtype)
                if self.capture_stream is not None:
                    torch.cuda.current_stream(device).wait_stream(self.capture_stream)
                if self.pmodel.fsdp and fsdp_dtype != "float32":
                    log(f"FSDP2: blocks' parameters all-gathered and computed in {fsdp_dtype}, fp32 shards "
                        "updated, gradients reduced in fp32")
            except ValueError as exc:
                raise ConfigError(f"parallel: {exc}") from None
            self.model = self.pmodel.gpts[0]
            named = list(self.pmodel.named_parameters())
        else:
            self.pmodel = None
            model.to_empty(device=device)
            model.init_weights(generator=generator)
            if t.fp8 != "none":
                from megakern import fp8

                fp8.convert_linears(model.blocks, recipe=fp8_recipe(t.fp8))
            self.model = model
            named = list(model.named_parameters())
        self.has_fp8 = any(type(m).__module__ == "megakern.fp8" and type(m).__name__ == "Linear"
                           for m in self.model.modules())

        # precision: bf16 parameters get fp32 master weights, which the optimizer updates
        groups = param_groups(named, c.optim, tied=c.model.tie_embeddings)
        self.names = {}
        for name, p in named:
            self.names.setdefault(p, name)
        self.masters = None
        if precision == "bf16":
            self.masters = {}
            for g in groups:
                g["params"] = [self.masters.setdefault(p, p.detach().float().clone().requires_grad_())
                               for p in g["params"]]
            with torch.no_grad():
                for p in self.masters:
                    p.data = p.data.to(torch.bfloat16)
            self.opt_names = {m: self.names[p] for p, m in self.masters.items()}
        else:
            self.opt_names = dict(self.names)
        # (a CUDA graph cannot keep autocast's cache of casts between captures: it is off there)
        self.autocast = (torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=not t.cuda_graph)
                         if precision == "bf16-autocast" else contextlib.nullcontext())

        self.forward = torch.compile(self.model) if t.compile else self.model
        self.optim_impl = optimizer_impl(c.optim, device, precision, self.parallel)
        kwargs = optimizer_kwargs(c.optim, self.optim_impl)
        if t.cuda_graph:  # the step and the learning rate on the device (one tensor, every group), read by the graph
            kwargs.update(capturable=True, lr=torch.tensor(float(kwargs["lr"]), device=device))
        self.optimizer = (self.pmodel.build_optimizer(torch.optim.AdamW, params=groups, **kwargs) if self.parallel
                          else torch.optim.AdamW(groups, **kwargs))
        # a non-finite step is skipped by the fused optimizer on the device (no sync), else on the host
        # (over several ranks too: loss and norm are reduced over every group, so all ranks skip alike)
        self.device_skip = device_skip(self.optimizer)
        # bf16 weights: one pass updates the masters and writes the weights, reading the bf16 gradients themselves
        # when there is one micro-batch a step (megakern.optim; else the fp32 master gradients accumulated)
        self.master_step = None
        if self.optim_impl == "megakern":
            from megakern.optim import MasterAdamW

            self.master_step = MasterAdamW(self.optimizer, {m: p for p, m in self.masters.items()})
        self.clip_divisor = None  # the fused optimizer's grad_scale when it does the clipping (_micro_steps)

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
        (self.pmodel if self.parallel else self.model).train(mode)

    def run(self, samples: list[dict], number: int) -> StepFigures:
        """Step ``number`` (1-based) on ``samples`` (``draws`` draws of the data loader), queued: its figures, read
        on the host by ``.read()``. In one process each micro-batch moves to the device when the loop reaches it."""
        if self.parallel:
            figures = self.figures([self.to_device(s) for s in samples])
        else:
            figures = self._micro_steps(self.to_device(s) for s in samples)
        if self.device_skip:
            return self.to_host(self.device_step(figures), number)
        return self.host_step(figures, number)

    def to_device(self, sample: dict) -> Batch:
        with self.range("data"):
            return to_batch(sample, self.device, self.eod_id)

    def figures(self, batches: list[Batch]) -> list[torch.Tensor]:
        """Forward and backward of the step's batches and the clipping: [mean loss, norm (, FP8's flag)] on the
        device. In a parallel run, ``batches`` is the rank's step batch, which forward_backward cuts into
        micro-batches."""
        if not self.parallel:
            return self._micro_steps(iter(batches))
        clip = self.config.train.grad_clip
        with self.range("forward_backward"), self.autocast:
            loss = self.pmodel.forward_backward(batches[0].inputs, batches[0].targets, check_values=False)
        with self.range("optimizer"):
            norm = self.pmodel.clip_grad_norm_(clip if clip > 0 else math.inf)
        return [loss.float(), norm.float()]

    def _micro_steps(self, micro_batches) -> list[torch.Tensor]:
        """Forward and backward of each micro-batch, then the gradient norm (clipped): the step's figures [mean
        loss, norm (, FP8's non-finite flag)] on the device."""
        model, accum, clip = self.forward, self.accum, self.config.train.grad_clip
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        for micro, batch in enumerate(micro_batches):
            with self.range("forward"), self.autocast:
                loss = model(batch.inputs, batch.targets, **batch.model_kwargs(), check_values=False)
            with self.range("backward"):
                (loss / accum).backward()
            loss_sum += loss.detach().float()
            if self.masters is not None:
                self._accumulate_master_grads(first=micro == 0)
        with self.range("optimizer"):
            if self.master_step is not None and self.accum == 1:  # the bf16 gradients themselves
                params = list(self.masters)
            elif self.masters is not None:
                params = list(self.masters.values())
            else:
                params = [p for g in self.optimizer.param_groups for p in g["params"]]
            grads = [p for p in params if p.grad is not None]
            self.clip_divisor = None
            if clip > 0 and not self.device_skip:
                norm = torch.nn.utils.clip_grad_norm_(grads, clip, foreach=True)
            else:
                from megakern.optim import total_norm

                norm = total_norm([p.grad for p in grads]).to(self.device)  # summed in fp32 (bf16 gradients too)
                if clip > 0:
                    # the fused optimizer divides the gradients by its grad_scale as it reads them: clipping rides
                    # in the update instead of a pass over every gradient (clip_grad_norm_'s coefficient, as a
                    # divisor)
                    self.clip_divisor = torch.clamp((norm.float() + 1e-6) / clip, min=1.0)
            figures = [loss_sum / accum, norm.float()]
            if self.has_fp8:
                from megakern import fp8

                figures.append(fp8.update_scales(self.model).to(self.device, torch.float32))
            return figures

    @torch.no_grad()
    def _accumulate_master_grads(self, first: bool) -> None:
        """fp32 master gradients (allocated once) += the bf16 gradients of this micro-batch (= on the first); the
        bf16 gradients are then dropped. With megakern's master step and one micro-batch a step there is nothing to
        accumulate: it reads the bf16 gradients."""
        if self.master_step is not None and self.accum == 1:
            return
        pairs = [(m, p.grad) for p, m in self.masters.items() if p.grad is not None]
        if first:
            for p, m in self.masters.items():
                if m.grad is None:
                    m.grad = torch.zeros_like(m)
                elif p.grad is None:  # unused in this micro-batch
                    m.grad.zero_()
            torch._foreach_copy_([m.grad for m, _ in pairs], [g for _, g in pairs])
        else:
            torch._foreach_add_([m.grad for m, _ in pairs], [g for _, g in pairs])
        for p in self.masters:
            p.grad = None

    @torch.no_grad()
    def copy_masters(self) -> None:
        """bf16 parameters <- their fp32 master weights (round to nearest even)."""
        if self.masters is not None:
            torch._foreach_copy_(list(self.masters), list(self.masters.values()))

    def host_step(self, figures: list[torch.Tensor], number: int) -> StepFigures:
        """The optimizer step after reading the figures on the host (a sync), skipped if loss or norm is not finite
        (or the FP8 flag, a third figure, is set)."""
        result = StepFigures(number, self.step_values(figures).cpu())
        if result.read()[2]:
            self._optimizer_step()
            self.copy_masters()
        if self.masters is None:  # the masters' gradients are overwritten by the next step's first micro-batch
            self.optimizer.zero_grad(set_to_none=True)
        return result

    def step_values(self, figures: list[torch.Tensor]) -> torch.Tensor:
        """(loss, norm, 1.0 if the step must be skipped) as one fp32 (3,) device tensor."""
        loss, norm = (f.to(self.device, torch.float32).reshape(()) for f in figures[:2])
        bad = ~(torch.isfinite(loss) & torch.isfinite(norm))
        if len(figures) > 2:
            bad = bad | (figures[2].to(self.device).reshape(()) != 0)
        return torch.stack([loss, norm, bad.to(torch.float32)])

    def device_step(self, figures: list[torch.Tensor]) -> torch.Tensor:
        """The fused optimizer's step, which skips itself on the device when the step is bad; nothing is read on
        the host (this is what a CUDA-graph step captures). Returns the step's values."""
        values = self.step_values(figures)
        if self.master_step is not None:  # masters, moments and bf16 weights in one pass; skipped on values[2]
            self.master_step.step(grad_scale=self.clip_divisor, found_inf=values[2])
            for p in self.masters:
                p.grad = None
            return values
        # 0-d fp32 device tensors: the clipping divisor (see _micro_steps) and the skip flag
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
        """After a CUDA graph captured ``device_step``: megakern's master step writes the pointer tables it built
        during the capture, before the first replay."""
        if self.master_step is not None:
            self.master_step.flush()

    def _optimizer_step(self) -> None:
        """optimizer.step(); over FSDP2's DTensor shards it runs on their local tensors (the same update, without
        DTensor's per-call dispatch: see megakern.parallel.data_parallel.local_shards)."""
        if self.parallel and self.pmodel.fsdp:
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
        """The mean loss of one held-out micro-batch (over the ranks' shards in a parallel run), no gradients."""
        with self.autocast:
            if self.parallel:
                return self.pmodel.eval_loss(batch.inputs, batch.targets, check_values=False).float()
            return self.forward(batch.inputs, batch.targets, **batch.model_kwargs()).float()
