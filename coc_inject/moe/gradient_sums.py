"""The experts' parameter gradients summed over the pieces of one layer call, in place.

Megatron's experts compute each weight gradient with one GEMM over all the expert's rows, accumulated
in fp32 inside the GEMM and rounded once to the parameter's dtype. A piece's GEMM sees only its rows and
rounds its share; the shares of a half-precision parameter are summed in fp32 and the sum rounded once,
so the result stays within a rounding or two of Megatron's (a bf16 running sum would round at every
piece). The memory that costs is bounded:

* the first piece's gradient is kept as autograd gave it; from the second piece on, one accumulator of
  the parameter's own (fp32 for a half parameter) takes every later share in place;
* a parameter's sum is rounded to its dtype after the LAST piece that reaches it, so the fp32
  accumulators alive at once are those of one local expert (SequentialMLP: an expert's pieces run one
  after another) -- of every local expert only for grouped experts, whose parameters every piece reaches;
* a linear with fused accumulation (``gradient_accumulation_fusion``) has added its share into
  ``main_grad`` itself and returned a placeholder (``grad_added_to_main_grad``): no placeholder is kept
  or copied. The parameter gets a zero-strided zero, which costs nothing until its AccumulateGrad
  materialises it, one parameter at a time, and Megatron's DDP hook drops it -- as Megatron's own
  placeholder (a zero one where ``zero_out_wgrad`` asks the hook to add it).
"""

from __future__ import annotations

import torch

HALF = (torch.float16, torch.bfloat16)


class GradientSums:
    """``params``' gradients over pieces ``0..P-1``; ``reaches[p]``: the indices of the parameters piece
    ``p`` can reach (its local expert's), None: every parameter (grouped experts)."""

    def __init__(self, params, reaches: list):
        self.params = params
        every = range(len(params))
        self.reaches = [tuple(every) if indices is None else tuple(indices) for indices in reaches]
        self._last = {}  # parameter index -> the last piece that reaches it
        for piece, indices in enumerate(self.reaches):
            self._last.update((index, piece) for index in indices)
        self._held = [None] * len(params)  # first share as given, then an accumulator of ours, then the result
        self._owned = [False] * len(params)  # _held[i] is our accumulator (added into in place)
        self._placeholder = [False] * len(params)
        self._none = [False] * len(params)  # reached, and every piece gave None (see results)

    def add(self, piece: int, grads: list) -> None:
        """Piece ``piece``'s gradients of the parameters ``reaches[piece]``, in that order (None: not used);
        ``grads`` is emptied as it is read, each share freed once added."""
        for position, index in enumerate(self.reaches[piece]):
            grad, grads[position] = grads[position], None
            if grad is not None:
                self._add(index, grad)
            elif self._held[index] is None and not self._placeholder[index] and hasattr(self.params[index],
                                                                                         "main_grad"):
                self._none[index] = True  # Megatron's fused accumulation returned None: the share is in main_grad
            grad = None
            if self._last[index] == piece and self._held[index] is not None:
                self._held[index] = self._held[index].to(self.params[index].dtype)  # rounded once
                self._owned[index] = False

    def _add(self, index: int, grad) -> None:
        held = self._held[index]
        if getattr(self.params[index], "grad_added_to_main_grad", False):
            if held is not None:  # DDP's hook would skip the shares summed here: never silently lost
                raise RuntimeError("MoE overlap: an expert parameter's gradient went to main_grad after an "
                                   "earlier piece returned it (gradient_accumulation_fusion changed mid-call)")
            self._placeholder[index] = True  # the share is in main_grad already
        elif held is None:
            self._held[index] = grad
        elif self._owned[index]:
            held.add_(grad)  # fp32 += half: each share exact in fp32, as inside Megatron's one GEMM
        else:  # the second share: an accumulator of ours, the first share freed before the add
            total = held.float() if held.dtype in HALF else held.clone()
            self._held[index] = held = None
            total.add_(grad)
            self._held[index], self._owned[index] = total, True

    def results(self) -> list:
        """One gradient per parameter for autograd (each reaches its AccumulateGrad once)."""
        results = []
        for param, held, placeholder, none in zip(self.params, self._held, self._placeholder, self._none):
            if held is not None:
                results.append(held)
            elif placeholder:
                results.append(torch.zeros((), dtype=param.dtype, device=param.device).expand_as(param))
            elif none:  # as Megatron's linear returns it: gradient_accumulation_fusion with main_grad but not
                # Megatron's DDP (no grad_added_to_main_grad): the gradient is in main_grad, .grad stays None
                results.append(None)
            else:  # no piece reached it (an expert without rows anywhere): zeros, as from Megatron's experts,
                # which run every local expert, rows or none: its DDP hook fires as Megatron's would
                results.append(torch.zeros_like(param))
        self._held, self._none = [None] * len(self.params), [False] * len(self.params)
        return results
