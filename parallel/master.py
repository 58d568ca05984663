"""fp32 master weights of bf16 parameters, with their gradients accumulated in fp32 (Megatron's "main grads").

``MasterWeights(params)`` keeps an fp32 copy of each parameter (the master the optimizer updates) and turns the
parameter itself to bf16 (what forward and backward compute with). Gradients:

- ``accumulate=True``: a post-accumulate-grad hook on each bf16 parameter moves its gradient into the master's
  fp32 ``.grad`` as soon as autograd has produced it (copied on the parameter's first micro-batch of the step,
  added on the others) and drops the bf16 gradient. Micro-batches of any schedule (one after another, or a pipeline
  schedule's interleaving) thus accumulate in fp32, a bf16 gradient lives only until its hook runs, and the
  data-parallel reduction (``megakern.parallel.data_parallel.allreduce_tensors`` over the masters' gradients) moves
  fp32, as Megatron-LM's DDP with fp32 main grads does.
- ``accumulate=False`` (one micro-batch a step and no reduction over data-parallel ranks): the bf16 gradients stay
  on the parameters and the optimizer step reads them (megakern.optim.MasterAdamW does, in one pass).

``grad(p)`` is the gradient the step uses for parameter ``p`` in either case; ``copy_to_model()`` writes the masters
into the bf16 parameters (round to nearest even) after an optimizer step.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch


class MasterWeights:
    """fp32 masters of ``params`` (see the module docstring). ``masters``: {bf16 parameter: fp32 master}."""

    def __init__(self, params: Iterable[torch.nn.Parameter], *, accumulate: bool, dtype=torch.bfloat16):
        params = list(dict.fromkeys(params))  # a tied parameter once
        for p in params:
            if p.dtype != torch.float32:
                raise TypeError(f"MasterWeights: parameters must be float32 before their masters are made, got "
                                f"{p.dtype} (shape {tuple(p.shape)})")
        self.accumulate, self.dtype = accumulate, dtype
        self.masters = {p: p.detach().clone().requires_grad_() for p in params}
        with torch.no_grad():
            for p in params:
                p.data = p.data.to(dtype)
        self._fresh: set = set()
        self._hooks = []
        if accumulate:
            for p in params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._move_grad))

    @torch.no_grad()
    def _move_grad(self, p: torch.Tensor) -> None:
        m = self.masters[p]
        if p in self._fresh:
            self._fresh.discard(p)
            if m.grad is None:
                m.grad = p.grad.to(torch.float32)
            else:
                m.grad.copy_(p.grad)
        else:
            m.grad.add_(p.grad)
        p.grad = None

    def begin_step(self) -> None:
        """Before the step's first backward: the next gradient of each parameter overwrites its master's."""
        if self.accumulate:
            self._fresh = set(self.masters)

    @torch.no_grad()
    def end_step(self) -> None:
        """After the step's last backward: a parameter no micro-batch reached has a zero gradient this step."""
        for p in self._fresh:
            m = self.masters[p]
            if m.grad is None:
                m.grad = torch.zeros_like(m)
            else:
                m.grad.zero_()
        self._fresh = set()

    def grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """The gradient the step uses for parameter ``p`` (its master's fp32 gradient, or its own bf16 one)."""
        return self.masters[p].grad if self.accumulate else p.grad

    def drop_model_grads(self) -> None:
        """After the optimizer step: the bf16 gradients (``accumulate=False``) are not needed any more."""
        for p in self.masters:
            p.grad = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """bf16 parameters <- their fp32 masters."""
        torch._foreach_copy_(list(self.masters), list(self.masters.values()))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
