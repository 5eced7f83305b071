"""The round boundary: what the training thread pays for a round is one snapshot of the weights and,
later, one fused update of them; the arithmetic in between runs in the round's own thread.

    >>> b = Boundary(list(model.parameters()), numel=n)
    >>> b.snapshot()                     # training thread, at the step a round starts
    >>> b.pseudo_grad_(anchor)           # round thread: delta = anchor - snapshot, in place
    >>> b.stage_preview(momentum, ...)   # round thread, eager: W += preview - snapshot, staged
    >>> b.apply_ready()                  # training thread, every step: the staged correction, if any
    >>> b.stage_outer(anchor, step_fn)   # round thread, when the group's average is in: W += A' - base

Every weight correction has the form W += new_base - old_base, where the base is what the local
steps started from (the snapshot, the eager preview, or the new anchor): the steps taken since the
snapshot are kept exactly, however many there were. One host buffer of the model's size, allocated
once: `delta` (the snapshot, turned into the pseudo-gradient in place, and at the round's end into
the correction A' - base). The preview's correction needs no buffer of its own on the CPU: the
training thread adds a * momentum + (1 + b) * delta (diloco.preview_coefficients), two fused adds,
and undoes it the same way. On CUDA `delta` is pinned, the snapshot is a device-to-device copy into
a buffer on the GPU moved to `delta` by the round's thread on a side stream, and a second pinned
buffer `corr` holds the preview's correction (the momentum lives in pageable shared memory, which
the training stream should not copy from).

A round that ends before the training thread took the preview's correction retracts it, and its
outcome is computed from the snapshot instead.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

import torch

from p2pdiloco import diloco

# the states of the staged correction
FREE, PREVIEW, FINAL = "free", "preview", "final"


def _views(flat: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of a flat vector shaped like each parameter, in order."""
    views, offset = [], 0
    for p in params:
        views.append(flat[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()
    return views


class Boundary:
    """The buffers of a round boundary and the hand-over of corrections (see the module docstring).
    The training thread calls snapshot() and apply_ready(); the round's thread everything else."""

    def __init__(self, params: list[torch.Tensor], *, numel: int):
        self.params = params
        self.device = params[0].device
        cuda = self.device.type == "cuda"
        self.delta = torch.empty(numel, pin_memory=cuda)
        self.corr = torch.empty(numel, pin_memory=True) if cuda else None
        self.staging = torch.empty(numel, device=self.device) if cuda else None
        self._snapshot_views = _views(self.staging if cuda else self.delta, params)
        self._views = {}  # data_ptr -> views shaped like the parameters, of delta, corr and the momentum
        self._copied: Optional[torch.cuda.Event] = None
        self._side = torch.cuda.Stream(self.device) if cuda else None
        self._foreach = not cuda and all(p.dtype == torch.float32 for p in params)
        self._lock = threading.Lock()
        self._state = FREE
        self._terms: list[tuple[list, float]] = []  # the staged correction: sum of alpha x flat vector
        self.on_preview = False  # the local weights train from the eager preview (else from the snapshot)

    def _stage(self, state: str, *terms: tuple[torch.Tensor, float]) -> None:
        """A correction for the next step boundary: W += sum of alpha x flat (each flat of the model's size)."""
        views = []
        for flat, alpha in terms:
            if flat.data_ptr() not in self._views:
                self._views[flat.data_ptr()] = _views(flat, self.params)
            views.append((self._views[flat.data_ptr()], alpha))
        with self._lock:
            self._terms, self._state = views, state

    # ------------------------------------------------------------------ training thread

    @torch.no_grad()
    def snapshot(self) -> None:
        """Copy the weights (the base of the next pseudo-gradient). On CUDA a device-to-device copy,
        ordered on the training stream: the next optimizer step cannot overtake it."""
        for view, p in zip(self._snapshot_views, self.params):
            view.copy_(p, non_blocking=True)
        if self._side is not None:
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.on_preview = False

    @torch.no_grad()
    def apply_ready(self) -> Optional[str]:
        """The staged correction, if one is ready: "preview" or "final" (what was applied), else None."""
        if self._state == FREE:  # read without the lock: a correction staged meanwhile waits one step
            return None
        with self._lock:
            state, self._state = self._state, FREE
            if state == FREE:
                return None
            for views, alpha in self._terms:
                if self._foreach:
                    torch._foreach_add_(self.params, views, alpha=alpha)
                else:  # on CUDA from pinned host memory, in the training stream's order
                    for p, c in zip(self.params, views):
                        p.add_(c.to(p.device, p.dtype, non_blocking=True), alpha=alpha)
            self._terms = []
            self.on_preview = state == PREVIEW
            return state

    def ready(self) -> bool:
        return self._state != FREE

    # ------------------------------------------------------------------ round thread

    @torch.no_grad()
    def pseudo_grad_(self, anchor: torch.Tensor) -> torch.Tensor:
        """delta = anchor - snapshot, in place (call under the state lock)."""
        if self._side is not None:
            with torch.cuda.stream(self._side):
                self._side.wait_event(self._copied)
                self.delta.copy_(self.staging, non_blocking=True)
            self._side.synchronize()
        return torch.sub(anchor, self.delta, out=self.delta)

    def _coefficients(self, cfg, own_share: float) -> tuple[float, float]:
        return diloco.preview_coefficients(outer_lr=cfg.outer_lr, outer_momentum=cfg.outer_momentum,
                                           own_share=own_share)

    @torch.no_grad()
    def stage_preview(self, momentum: torch.Tensor, cfg, *, own_share: float) -> None:
        """preview - snapshot = a * momentum + (1 + b) * delta: the local weights move onto the eager
        preview at the next step boundary. Neither momentum nor delta changes before the round's end,
        which takes the correction back (take_base) if the training thread has not applied it."""
        a, b = self._coefficients(cfg, own_share)
        if self.corr is None:
            self._stage(PREVIEW, (momentum, a), (self.delta, 1 + b))
        else:
            torch.mul(momentum, a, out=self.corr).add_(self.delta, alpha=1 + b)
            self._stage(PREVIEW, (self.corr, 1.0))

    def take_base(self) -> bool:
        """At the round's end: retract a preview correction not applied yet; True when the local weights
        train from the preview (the base of the outcome's correction), False for the snapshot."""
        with self._lock:
            if self._state == PREVIEW:
                self._state, self._terms = FREE, []
            return self.on_preview

    @torch.no_grad()
    def stage_undo(self, momentum: torch.Tensor, cfg, *, own_share: float) -> None:
        """A failed round after the preview was applied: snapshot - preview (nothing of our own work is
        lost; the next pseudo-gradient carries it). Momentum and delta stay as they are until the
        training thread applied it: the next round starts after."""
        a, b = self._coefficients(cfg, own_share)
        if self.corr is None:
            self._stage(FINAL, (momentum, -a), (self.delta, -(1 + b)))
        else:
            torch.mul(momentum, -a, out=self.corr).add_(self.delta, alpha=-(1 + b))
            self._stage(FINAL, (self.corr, 1.0))

    @torch.no_grad()
    def stage_outer(self, anchor: torch.Tensor, momentum: torch.Tensor, cfg, *, preview: bool, own_share: float,
                    move: Callable[[], None]) -> None:
        """A' - base, in delta (the pseudo-gradient is no longer needed), where move() turns anchor (and
        momentum) into A' in place and base is the preview or the snapshot of the old anchor and
        momentum. Call under the state lock."""
        if preview:  # -base = -(anchor + a * momentum + b * delta)
            a, b = self._coefficients(cfg, own_share)
            self.delta.mul_(-b).sub_(momentum, alpha=a).sub_(anchor)
        else:  # -base = delta - anchor
            self.delta.sub_(anchor)
        move()
        self.delta.add_(anchor)
        self._stage(FINAL, (self.delta, 1.0))
