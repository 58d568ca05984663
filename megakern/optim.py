"""AdamW on fp32 master weights that writes the bf16 model weights in the same pass: ``MasterAdamW``.

Training with bf16 weights and fp32 master weights in plain torch costs three passes over the parameters after the
backward: the bf16 gradients copied into fp32 master gradients, torch's fused AdamW over the masters, and the
masters copied back into the bf16 weights. ``MasterAdamW(optimizer, models).step()`` does it in one: a Triton
multi-tensor kernel (megakern._optim_triton) reads each gradient in its own dtype (bf16 straight from the backward,
or fp32 master gradients accumulated over micro-batches), applies torch's fused AdamW update to the master, both
moments and the step count, and writes the rounded bf16 weight. On a GPT-350M step that is 28 bytes a parameter
instead of 40.

It drives a ``torch.optim.AdamW`` and keeps nothing of its own: hyperparameters come from its param_groups (``lr``
a float, or a device tensor as with ``capturable=True``, read at run time), state lives in ``optimizer.state``
with torch's fused layout (``step`` a 0-d fp32 device tensor, ``exp_avg``, ``exp_avg_sq``), so state_dict,
checkpoints and ``optimizer.step()`` itself keep working. ``grad_scale`` (the gradients are divided by it: gradient
clipping as a divisor) and ``found_inf`` (nonzero: the step is skipped, state untouched) are device tensors, as
for torch's fused optimizers, so a step needs no host sync and can be captured in a CUDA graph.

The kernel finds each tensor through an int64 table of addresses (a row per tensor), rewritten on the host when an
address changes and cached otherwise, and a work list of blocks built once per set of sizes (megakern._tables).
Inside CUDA-graph capture the graph takes over the tables of the eager step before it (a capture needs one) and
their new addresses are written when ``flush()`` is called after the capture, before the first replay.

``SumOfSquares()(tensors)``: the fp32 sum of squares of many tensors (the clipping norm's, squared) through the same
tables, one launch per dtype.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from megakern import _backend
from megakern._tables import AddressTables

# H100, GPT-350M's 292 tensors (profiles/tune_optim.py): 1024 x 4 warps 0.96 of copy, 2048 x 8 0.94, 4096 x 8 0.84
BLOCK, WARPS = 1024, 4
# SumOfSquares: a read-only pass of 16-byte loads (profiles/tune_optim.py --sumsq)
SUMSQ_BLOCK, SUMSQ_WARPS = 4096, 4


class SumOfSquares:
    """The sum of squares of many tensors, in fp32 (a 0-d tensor on their device): the squared 2-norm of a model's
    gradients for clipping, one Triton launch per dtype (megakern._sumsq_triton) where torch._foreach_norm makes
    dozens. ``SumOfSquares()(tensors)``: tensors of any float dtype and shape on one device (none: 0 on the CPU);
    contiguous fp32 / bf16 / fp16 ones on a device where Triton runs go through the kernel, the rest through torch
    (fp32 math too, fp64 for fp64 tensors).

    Launches find their tensors through address tables (megakern._tables): in a CUDA-graph capture the graph takes
    over the tables of the eager call before it and ``flush()`` writes their new addresses after the capture, before
    the first replay, as for ``MasterAdamW`` (tensors a capture meets without such an eager call go through torch).
    The partial sums are added in a fixed order: the same bits every run."""

    def __init__(self, *, block: int = SUMSQ_BLOCK, warps: int = SUMSQ_WARPS):
        if block < 16 or block & (block - 1):
            raise ValueError(f"SumOfSquares: block must be a power of two >= 16, got {block}")
        if warps < 1 or warps & (warps - 1):
            raise ValueError(f"SumOfSquares: warps must be a power of two >= 1, got {warps}")
        self.block, self.warps = block, warps
        self._tables = None

    def __call__(self, tensors) -> torch.Tensor:
        tensors = list(tensors)
        device = tensors[0].device if tensors and isinstance(tensors[0], torch.Tensor) else None
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"SumOfSquares: expected tensors, got a {type(t).__name__}")
            if not t.is_floating_point() or t.device != device:
                raise TypeError(f"SumOfSquares: every tensor must be a floating-point tensor on {device}, got "
                                f"{t.dtype} on {t.device}")
        tensors = [t for t in tensors if t.numel()]
        if not tensors:
            return torch.zeros((), dtype=torch.float32, device=device)
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        rest = []
        fast = not _backend.triton_problem(device)
        for t in tensors:
            if fast and t.dtype in (torch.float32, torch.bfloat16, torch.float16) and t.is_contiguous():
                by_kind.setdefault((t.dtype, t.data_ptr() % 16 == 0), []).append(t)
            else:
                rest.append(t)
        parts = []
        if by_kind:
            from megakern import _sumsq_triton as kern

            if self._tables is None:
                self._tables = AddressTables(kern.ROW, self.block, "SumOfSquares")
            for (dtype, aligned), members in by_kind.items():
                rows = tuple((t.numel(), t.data_ptr()) for t in members)
                if not self._tables.ready((dtype, aligned), rows, device):  # a capture with no eager call first
                    rest += members
                    continue
                work, table, programs = self._tables.get((dtype, aligned), rows, device)
                partials = torch.empty(programs, dtype=torch.float32, device=device)
                kern.launch(work, table, partials, programs=programs, dtype=dtype, block=self.block,
                            warps=self.warps, aligned=aligned)
                parts.append(partials.sum())
        by_acc: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in rest:  # torch's path: fp32 math, fp64 for fp64 tensors
            by_acc.setdefault(torch.promote_types(t.dtype, torch.float32), []).append(t)
        for acc, members in by_acc.items():
            norms = torch._foreach_norm(members, 2, dtype=acc)
            parts.append(torch.stack(norms).square().sum().float())
        return parts[0] if len(parts) == 1 else torch.stack(parts).sum()

    def flush(self) -> None:
        """Writes the tables built during a CUDA-graph capture; call it after the capture, before the replay."""
        if self._tables is not None:
            self._tables.flush()


def total_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of a list of tensors, summed in fp32 whatever their dtype (a 0-d fp32 tensor): a one-off
    ``SumOfSquares``' square root."""
    return SumOfSquares()(tensors).sqrt()


class MasterAdamW:
    """AdamW steps of ``optimizer`` (a torch.optim.AdamW over fp32 master weights) that also write the model
    weights: ``models`` maps each master to its low-precision copy in the model (bf16 / fp16; None: no copy).

    ``step(grad_scale=None, found_inf=None)`` takes each master's gradient from ``master.grad`` when set, else from
    its model weight's ``.grad``; a master with neither is skipped (as torch's optimizers skip it). CUDA tensors, or
    CPU tensors under the Triton interpreter (TRITON_INTERPRET=1), for tests. ``block`` elements per program, ``warps``
    per program: measured on an H100 (profiles/tune_optim.py)."""

    def __init__(self, optimizer: torch.optim.Optimizer, models: Mapping[torch.Tensor, torch.Tensor | None], *,
                 block: int = BLOCK, warps: int = WARPS):
        if type(optimizer) is not torch.optim.AdamW:
            raise TypeError(f"MasterAdamW drives a torch.optim.AdamW, got {type(optimizer).__name__}")
        if block < 16 or block & (block - 1):
            raise ValueError(f"MasterAdamW: block must be a power of two >= 16, got {block}")
        self.optimizer, self.block, self.warps = optimizer, block, warps
        self.models = dict(models)
        for i, group in enumerate(optimizer.param_groups):
            for key in ("amsgrad", "maximize", "differentiable"):
                if group.get(key):
                    raise ValueError(f"MasterAdamW: param group {i} sets {key}=True, which it does not implement")
            for p in group["params"]:
                self._check_master(p, i)
        from megakern._optim_triton import ROW  # (Triton: after the checks, which say where it cannot run)

        # launch key = (group, dtypes): its work list and address table (megakern._tables)
        self._tables = AddressTables(ROW, block, "MasterAdamW.step")

    def _check_master(self, p: torch.Tensor, group: int) -> None:
        where = f"MasterAdamW: a parameter of group {group} (shape {tuple(p.shape)})"
        if p.dtype != torch.float32:
            raise TypeError(f"{where} is {p.dtype}; master weights must be float32")
        if not p.is_contiguous():
            raise ValueError(f"{where} is not contiguous")
        problem = _backend.triton_problem(p.device)
        if problem:
            raise RuntimeError(f"{where} is on {p.device}: {problem}")
        if p not in self.models:
            raise KeyError(f"{where} has no entry in models (map it to its model weight, or to None)")
        model = self.models[p]
        if model is not None:
            if model.shape != p.shape or model.device != p.device or not model.is_contiguous():
                raise ValueError(f"{where}: its model weight has shape {tuple(model.shape)} on {model.device}"
                                 f"{'' if model.is_contiguous() else ', not contiguous'}; it must match the master")
            if model.dtype not in (torch.bfloat16, torch.float16, torch.float32):
                raise TypeError(f"{where}: its model weight is {model.dtype}; expected bfloat16, float16 or float32")

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        if p.grad is not None:
            return p.grad
        model = self.models[p]
        return model.grad if model is not None else None

    def _state(self, p: torch.Tensor) -> dict:
        state = self.optimizer.state[p]
        if not state:  # torch's fused AdamW layout, so optimizer.step() and state_dict() see the same state
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif state["step"].device != p.device or state["step"].dtype != torch.float32:
            state["step"] = state["step"].to(p.device, torch.float32)  # a checkpoint's CPU step
        return state

    @torch.no_grad()
    def step(self, grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None) -> None:
        from megakern import _optim_triton as kern

        for name, t in (("grad_scale", grad_scale), ("found_inf", found_inf)):
            if t is not None and (t.numel() != 1 or t.dtype != torch.float32):
                raise ValueError(f"MasterAdamW.step: {name} must be a one-element float32 tensor, got "
                                 f"{t.dtype} of shape {tuple(t.shape)}")
        steps = []
        launches = []
        for gi, group in enumerate(self.optimizer.param_groups):
            beta1, beta2 = (float(b) for b in group["betas"])
            by_kind: dict[tuple, list] = {}
            for p in group["params"]:
                grad = self._grad(p)
                if grad is None:
                    continue
                if grad.shape != p.shape or grad.device != p.device:
                    raise ValueError(f"MasterAdamW.step: a gradient of shape {tuple(grad.shape)} on {grad.device} "
                                     f"for a master of shape {tuple(p.shape)} on {p.device}")
                if str(grad.dtype) not in kern.TL_DTYPES:
                    raise TypeError(f"MasterAdamW.step: a gradient is {grad.dtype}; expected float32, bfloat16 or "
                                    f"float16")
                grad = grad.contiguous()
                state = self._state(p)
                steps.append(state["step"])
                model = self.models[p]
                # one launch per dtypes, and per alignment: 16-byte aligned tensors take the vectorized kernel
                tensors = (p, grad, state["exp_avg"], state["exp_avg_sq"]) + (() if model is None else (model,))
                aligned = all(t.data_ptr() % 16 == 0 for t in tensors)
                kind = (grad.dtype, model.dtype if model is not None else None, aligned)
                by_kind.setdefault(kind, []).append((p, grad, state, model))
            for kind, members in by_kind.items():
                launches.append((gi, group, kind, members, beta1, beta2))
        if not steps:
            return
        # the step count first (the update reads the new count); a skipped step leaves it unchanged
        # (a list of 0-d tensors: _foreach_add_ with one tensor operand reads its value on the host, a sync)
        if found_inf is not None:
            torch._foreach_add_(steps, [1.0 - found_inf.reshape(())] * len(steps))
        else:
            torch._foreach_add_(steps, 1.0)
        for gi, group, kind, members, beta1, beta2 in launches:
            work, table, programs = self._tables_for((gi, kind), members)
            lr = group["lr"]
            lr = lr.reshape(()) if isinstance(lr, torch.Tensor) else float(lr)
            kern.launch(work, table, programs=programs, lr=lr, beta1=beta1, beta2=beta2,
                        log2_beta1=math.log2(beta1) if beta1 > 0 else -math.inf,
                        log2_beta2=math.log2(beta2) if beta2 > 0 else -math.inf,
                        eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                        grad_scale=grad_scale, found_inf=found_inf, grad_dtype=kind[0], model_dtype=kind[1],
                        block=self.block, warps=self.warps, aligned=kind[2])

    def _tables_for(self, key, members) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(work list, table, programs) for one launch: a row per tensor, (numel, master, gradient, exp_avg,
        exp_avg_sq, step, model copy, 0) (megakern._optim_triton's table)."""
        rows = tuple((p.numel(), p.data_ptr(), grad.data_ptr(), state["exp_avg"].data_ptr(),
                      state["exp_avg_sq"].data_ptr(), state["step"].data_ptr(),
                      model.data_ptr() if model is not None else 0, 0) for p, grad, state, model in members)
        return self._tables.get(key, rows, members[0][0].device)

    def flush(self) -> None:
        """Writes the tables built during a CUDA-graph capture; call it after the capture, before the replay."""
        self._tables.flush()
