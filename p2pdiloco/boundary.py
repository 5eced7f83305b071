"""The round boundary: what the training thread pays for a round is one snapshot of the weights and,
later, one fused update of them; the arithmetic in between runs in the round's own thread.

    >>> b = Boundary(list(model.parameters()), numel=n)
    >>> b.snapshot()                     # training thread, at the step a round starts
    >>> b.pseudo_grad_(anchor)           # round thread: delta = anchor - snapshot, in place
    >>> b.stage_preview(momentum, ...)   # round thread, eager: corr = preview - snapshot
    >>> b.apply_ready()                  # training thread, every step: W += corr when one is ready
    >>> b.stage_outer(anchor, step_fn)   # round thread, when the group's average is in: corr = A' - base

Every weight correction has the form W += new_base - old_base, where the base is what the local
steps started from (the snapshot, the eager preview, or the new anchor): the steps taken since the
snapshot are kept exactly, however many there were. Two host buffers of the model's size, allocated
once (pinned on CUDA): `delta` (the snapshot, turned into the pseudo-gradient in place) and `corr`
(the correction waiting for the next step boundary). On CUDA the snapshot is a device-to-device copy
into a third buffer on the GPU, moved to `delta` by the round's thread on a side stream.

The preview's correction needs no anchor (diloco.preview_coefficients): preview - snapshot is
a * momentum + (1 + b) * delta. A round that ends before the training thread took the preview's
correction retracts it, and its outcome is computed from the snapshot instead.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

import torch

from p2pdiloco import diloco

# the states of `corr`
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
        self.corr = torch.empty(numel, pin_memory=cuda)
        self.staging = torch.empty(numel, device=self.device) if cuda else None
        self._delta_views = _views(self.staging if cuda else self.delta, params)
        self._corr_views = _views(self.corr, params)
        self._copied: Optional[torch.cuda.Event] = None
        self._side = torch.cuda.Stream(self.device) if cuda else None
        self._foreach = all(p.dtype == torch.float32 for p in params)
        self._lock = threading.Lock()
        self._state = FREE
        self.on_preview = False  # the local weights train from the eager preview (else from the snapshot)

    # ------------------------------------------------------------------ training thread

    @torch.no_grad()
    def snapshot(self) -> None:
        """Copy the weights (the base of the next pseudo-gradient). On CUDA a device-to-device copy,
        ordered on the training stream: the next optimizer step cannot overtake it."""
        for view, p in zip(self._delta_views, self.params):
            view.copy_(p, non_blocking=True)
        if self._side is not None:
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.on_preview = False

    @torch.no_grad()
    def apply_ready(self) -> Optional[str]:
        """W += corr if a correction is ready: "preview" or "final" (what was applied), else None."""
        if self._state == FREE:  # read without the lock: a correction staged meanwhile waits one step
            return None
        with self._lock:
            state, self._state = self._state, FREE
            if state == FREE:
                return None
            if self._foreach and self._side is None:
                torch._foreach_add_(self.params, self._corr_views)
            else:  # from pinned host memory, in the training stream's order
                for p, c in zip(self.params, self._corr_views):
                    p.add_(c.to(p.device, p.dtype, non_blocking=True))
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
        """corr = preview - snapshot = a * momentum + (1 + b) * delta: the local weights move onto the
        eager preview at the next step boundary."""
        a, b = self._coefficients(cfg, own_share)
        torch.mul(momentum, a, out=self.corr).add_(self.delta, alpha=1 + b)
        with self._lock:
            self._state = PREVIEW

    def take_base(self) -> bool:
        """At the round's end: retract a preview correction not applied yet; True when the local weights
        train from the preview (the base of the outcome's correction), False for the snapshot."""
        with self._lock:
            if self._state == PREVIEW:
                self._state = FREE
            return self.on_preview

    @torch.no_grad()
    def stage_undo(self, momentum: torch.Tensor, cfg, *, own_share: float) -> None:
        """A failed round after the preview was applied: corr = snapshot - preview (nothing of our own
        work is lost; the next pseudo-gradient carries it)."""
        a, b = self._coefficients(cfg, own_share)
        torch.mul(momentum, -a, out=self.corr).add_(self.delta, alpha=-(1 + b))
        with self._lock:
            self._state = FINAL

    @torch.no_grad()
    def stage_outer(self, anchor: torch.Tensor, momentum: torch.Tensor, cfg, *, preview: bool, own_share: float,
                    move: Callable[[], None]) -> None:
        """corr = A' - base, where move() turns anchor (and momentum) into A' in place and base is the
        preview or the snapshot of the old anchor and momentum. Call under the state lock."""
        if preview:  # -base = -(anchor + a * momentum + b * delta)
            a, b = self._coefficients(cfg, own_share)
            torch.mul(momentum, -a, out=self.corr).sub_(anchor).add_(self.delta, alpha=-b)
        else:  # -base = delta - anchor
            torch.sub(self.delta, anchor, out=self.corr)
        move()
        self.corr.add_(anchor)
        with self._lock:
            self._state = FINAL
