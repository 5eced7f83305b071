"""The round boundary (boundary.py): the training thread's snapshot and fused corrections leave the
weights exactly where the papers' per-round math puts them, whatever the order of events."""

import threading
import time

import pytest
import torch

from p2pdiloco import diloco
from p2pdiloco.boundary import Boundary

LR, MU = 0.7, 0.9


class Cfg:
    outer_lr, outer_momentum = LR, MU


def make(seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g), torch.randn(2, 2, generator=g)]
    numel = sum(p.numel() for p in params)
    anchor, momentum = torch.randn(numel, generator=g), torch.randn(numel, generator=g)
    return params, anchor, momentum, g


def flat(params):
    return torch.cat([p.reshape(-1) for p in params])


def train(params, g):
    """Some local steps: any change of the weights."""
    step = []
    for p in params:
        d = torch.randn(p.shape, generator=g) * 0.1
        p.add_(d)
        step.append(d.reshape(-1))
    return torch.cat(step)


def new_anchor(anchor, momentum, average):
    a, m = anchor.clone(), momentum.clone()
    diloco.outer_step_(a, m, average, outer_lr=LR, outer_momentum=MU)
    return a, m


@pytest.mark.parametrize("eager, preview_taken", [(False, False), (True, True), (True, False)])
def test_an_applied_round_leaves_the_new_anchor_plus_every_step_since_the_snapshot(eager, preview_taken):
    params, anchor, momentum, g = make()
    b = Boundary(params, numel=anchor.numel())
    assert b.corr is None and b.staging is None  # on the CPU, one buffer of the model's size: delta
    b.snapshot()
    snapshot = flat(params)
    delta = b.pseudo_grad_(anchor)
    torch.testing.assert_close(delta, anchor - snapshot, rtol=0, atol=0)
    progress = train(params, g)
    if eager:
        b.stage_preview(momentum, Cfg, own_share=1.0)
        if preview_taken:
            assert b.apply_ready() == "preview"
            preview = diloco.preview_outer_step(anchor, momentum, delta, outer_lr=LR, outer_momentum=MU)
            torch.testing.assert_close(flat(params), preview + progress)
            progress = progress + train(params, g)  # steps on the preview are kept too
    average = torch.randn(anchor.numel(), generator=g)
    expected_anchor, expected_momentum = new_anchor(anchor, momentum, average)
    base_is_preview = b.take_base()
    assert base_is_preview == (eager and preview_taken)
    b.stage_outer(anchor, momentum, Cfg, preview=base_is_preview, own_share=1.0,
                  move=lambda: diloco.outer_step_(anchor, momentum, average, outer_lr=LR, outer_momentum=MU))
    torch.testing.assert_close(anchor, expected_anchor)
    torch.testing.assert_close(momentum, expected_momentum)
    assert b.apply_ready() == "final"
    assert b.apply_ready() is None  # one correction, applied once
    torch.testing.assert_close(flat(params), expected_anchor + progress, rtol=1e-5, atol=1e-5)


def test_a_failed_round_moves_the_progress_made_on_the_preview_back_onto_the_snapshot():
    params, anchor, momentum, g = make(1)
    b = Boundary(params, numel=anchor.numel())
    b.snapshot()
    snapshot = flat(params)
    b.pseudo_grad_(anchor)
    b.stage_preview(momentum, Cfg, own_share=0.25)
    progress = train(params, g)
    assert b.apply_ready() == "preview"
    progress = progress + train(params, g)
    assert b.take_base()
    b.stage_undo(momentum, Cfg, own_share=0.25)
    assert b.apply_ready() == "final"
    torch.testing.assert_close(flat(params), snapshot + progress, rtol=1e-5, atol=1e-5)


def test_corrections_cross_threads_without_loss():
    """The round's thread stages while the training thread polls: each correction is applied exactly once."""
    params, anchor, momentum, g = make(2)
    b = Boundary(params, numel=anchor.numel())
    b.snapshot()
    b.pseudo_grad_(anchor)
    applied = []
    done = threading.Event()

    def trainer():
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            kind = b.apply_ready()
            if kind:
                applied.append(kind)
            if done.is_set() and not b.ready():
                return

    t = threading.Thread(target=trainer)
    t.start()
    try:
        b.stage_preview(momentum, Cfg, own_share=1.0)
        deadline = time.monotonic() + 10
        while not applied and time.monotonic() < deadline:
            time.sleep(0.001)
        average = torch.randn(anchor.numel(), generator=g)
        expected, _ = new_anchor(anchor, momentum, average)
        b.stage_outer(anchor, momentum, Cfg, preview=b.take_base(), own_share=1.0,
                      move=lambda: diloco.outer_step_(anchor, momentum, average, outer_lr=LR, outer_momentum=MU))
        done.set()
    finally:
        done.set()
        t.join(timeout=30)
    assert applied == ["preview", "final"]
    torch.testing.assert_close(flat(params), expected, rtol=1e-5, atol=1e-5)


def test_preview_coefficients_give_the_preview():
    _, anchor, momentum, g = make(3)
    delta = torch.randn(anchor.numel(), generator=g)
    for share in (1.0, 0.5, 0.125):
        a, b = diloco.preview_coefficients(outer_lr=LR, outer_momentum=MU, own_share=share)
        torch.testing.assert_close(anchor + a * momentum + b * delta,
                                   diloco.preview_outer_step(anchor, momentum, delta, outer_lr=LR, outer_momentum=MU,
                                                             own_share=share))
