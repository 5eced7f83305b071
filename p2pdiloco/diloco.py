"""The DiLoCo math, in the papers' words: pseudo-gradient, one outer Nesterov step per group
average, the merge that keeps the local progress made while a round ran, the swarm-keyed lr
schedule, and a cheap anchor digest used to measure the spread of anchors across peers.

Per peer (see DESIGN.md):

    every inner_steps (H) inner steps:
        snapshot   = local.copy()
        pseudo_grad = anchor - snapshot                     # sent to a background round
    when the round returns the group average g (tau inner steps later):
        momentum = outer_momentum * momentum + g             # once per GROUP, never per arrival
        anchor  -= outer_lr * (g + outer_momentum * momentum)
        local    = anchor + (local - snapshot)              # keep the tau steps made meanwhile

All tensors here are flat fp32 vectors on the CPU.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

DIGEST_SIZE = 256


def pseudo_grad(anchor: torch.Tensor, snapshot: torch.Tensor) -> torch.Tensor:
    return anchor - snapshot


def outer_step_(anchor: torch.Tensor, momentum: torch.Tensor, avg_pseudo_grad: torch.Tensor, *,
                outer_lr: float, outer_momentum: float, scale: float = 1.0) -> None:
    """One Nesterov SGD step on the anchor with scale * avg_pseudo_grad, in place (same as
    torch.optim.SGD(nesterov=True)); no temporary of the model's size."""
    momentum.mul_(outer_momentum).add_(avg_pseudo_grad, alpha=scale)
    # anchor -= outer_lr * (scale * avg_pseudo_grad + outer_momentum * momentum)
    anchor.sub_(avg_pseudo_grad, alpha=outer_lr * scale).sub_(momentum, alpha=outer_lr * outer_momentum)


def group_share(swarm_views: list) -> float:
    """The share of the live swarm in a group: members / live peers, where live peers is the lower
    median of the members' views (one member cannot shrink everyone's step by overstating it).
    A group's average is scaled by it, so that k groups of N/k peers move the anchor about as far
    per unit of work as one group of N would: applied in full, each small group's average (same
    size as a full group's) would take a whole outer step, k times the step of synchronous DiLoCo."""
    views = sorted(max(1, int(v)) if isinstance(v, (int, float)) and math.isfinite(v) else 1 for v in swarm_views)
    if not views:
        return 1.0
    return min(1.0, len(views) / views[(len(views) - 1) // 2])


def fold_average(average: torch.Tensor, anchor: torch.Tensor, weight: float) -> None:
    """average += weight * (anchor - average), in place: the model a peer keeps, a moving average of its
    anchors (weight 1 restarts it from the anchor; OuterState picks the weight). One outer step moves the anchor's loss
    by several % on small groups; averaging the last iterates is the usual answer to a noisy last iterate
    (latest weight averaging: Kaddour, arXiv 2209.14981; Sanyal et al., arXiv 2306.03241)."""
    if weight >= 1:
        average.copy_(anchor)
    else:
        average.lerp_(anchor.to(average.device), weight)  # on a GPU: one copy of the anchor there, then freed


def merge_local(new_anchor: torch.Tensor, local: torch.Tensor, snapshot: torch.Tensor) -> torch.Tensor:
    """The new local weights: the new anchor plus the progress made since the snapshot."""
    return new_anchor + (local - snapshot)


def inner_lr_at(position: int, *, inner_lr: float, warmup_steps: int, total_steps: int,
                min_lr_ratio: float) -> float:
    """Linear warmup then cosine decay, keyed on the swarm position (outer_step * H + local steps)."""
    if warmup_steps and position < warmup_steps:
        return inner_lr * (position + 1) / warmup_steps
    if total_steps <= warmup_steps:
        return inner_lr
    progress = min(1.0, (position - warmup_steps) / max(1, total_steps - warmup_steps))
    return inner_lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def preview_coefficients(*, outer_lr: float, outer_momentum: float, own_share: float = 1.0) -> tuple[float, float]:
    """(a, b) such that the eager preview is anchor + a * momentum + b * pseudo_grad (preview_outer_step).
    The preview minus the snapshot (anchor - pseudo_grad) is then a * momentum + (1 + b) * pseudo_grad:
    the round's thread moves the local weights onto the preview without reading the anchor."""
    mu = outer_momentum
    # with g = own_share * pseudo_grad + (1 - own_share) * (1 - mu) * momentum:
    # anchor - outer_lr * (g + mu * (mu * momentum + g))
    return -outer_lr * (mu * mu + (1 + mu) * (1 - own_share) * (1 - mu)), -outer_lr * (1 + mu) * own_share


def preview_outer_step(anchor: torch.Tensor, momentum: torch.Tensor, pseudo_grad: torch.Tensor, *,
                       outer_lr: float, outer_momentum: float, own_share: float = 1.0) -> torch.Tensor:
    """Where `outer_step_` would move the anchor with an estimate of the group's average, without
    moving it: the eager update trains the round in flight from here until the average arrives
    (Kale et al., arXiv 2502.12996). The estimate is own_share x our pseudo-gradient + (1 - own_share)
    x the others' recent average; the paper takes the others' from the last round, we take the outer
    momentum's running mean, (1 - mu) x momentum, which needs no extra copy of the model. own_share 1
    (the default) is our pseudo-gradient alone."""
    a, b = preview_coefficients(outer_lr=outer_lr, outer_momentum=outer_momentum, own_share=own_share)
    return (momentum * a).add_(pseudo_grad, alpha=b).add_(anchor)


def anchors_differ(digests: list, tolerance: float) -> bool:
    """True when some two members' anchor digests are further apart than `tolerance`."""
    return any(digest_spread(a, b) > tolerance for i, a in enumerate(digests) for b in digests[i + 1:])


def merge_weights(members: list, tolerance: float) -> Optional[list[float]]:
    """The plan of a merge round, from what the members announced (digest, outer_step), or None
    when their anchors agree and the round averages pseudo-gradients only.

    When they differ, the round also averages anchors and outer momenta, so that nobody's outer
    progress is thrown away and every member leaves with the same anchor (arXiv 2506.10911 pulls
    anchors toward the group mean; here the pull is complete). Members at the group's newest outer
    step weigh 1 and the others 0: a member that missed rounds adopts the others' anchor, while
    groups that stepped apart (equal outer steps) meet in the middle."""
    digests = [m.get("digest") if isinstance(m, dict) else None for m in members]
    if len(members) < 2 or any(not isinstance(d, list) for d in digests):
        return None
    if not anchors_differ(digests, tolerance):
        return None
    steps = [m.get("outer_step") if isinstance(m.get("outer_step"), int) else -1 for m in members]
    newest = max(steps)
    return [1.0 if s == newest else 0.0 for s in steps]


def dynamic_inner_steps(inner_steps: int, own_speed, speeds: list, *, bound: float = 4.0) -> int:
    """Dynamic local updates (Liu et al., arXiv 2401.09135): H scaled by this peer's speed over the
    swarm's mean, so that fast and slow peers are due at the same moment and a round carries
    inner_steps steps per peer on average. Unknown speeds give H; the scale stays within [1/bound, bound]."""
    known = [s for s in speeds if isinstance(s, (int, float)) and math.isfinite(s) and s > 0]
    if not known or not isinstance(own_speed, (int, float)) or not math.isfinite(own_speed) or own_speed <= 0:
        return inner_steps
    scale = min(bound, max(1.0 / bound, own_speed / (sum(known) / len(known))))
    return max(1, round(inner_steps * scale))


def matchmaking_lead(previous_s: float, waits: list, *, cap_s: float) -> float:
    """Seconds before its inner_steps are done that a peer enters matchmaking, from the waits the
    group's members report (seconds from entering matchmaking to the group's formation, in their
    previous round). A full group forms when its last member arrives, so the others waited: on
    average, the group could have formed that much earlier. Entering earlier by the mean wait
    keeps a round every inner_steps steps instead of inner_steps plus the spread of arrivals
    (hivemind.Optimizer likewise starts matchmaking ahead of the swarm's estimated ready time).
    Every member derives the same lead from the same announcements, so their starts stay aligned;
    the new mean is halved with the previous lead to smooth one round's noise. Reports that are not
    finite numbers are ignored, the others clipped to [0, cap_s], and so is the lead."""
    known = [min(cap_s, max(0.0, float(w))) for w in waits
             if isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)]
    if not known:
        return max(0.0, min(cap_s, previous_s))
    return max(0.0, min(cap_s, 0.5 * previous_s + 0.5 * sum(known) / len(known)))


def digest_indices(numel: int) -> torch.Tensor:
    """Fixed positions (the same on every peer of a model config) sampled for the anchor digest."""
    g = torch.Generator().manual_seed(numel)
    return torch.randint(0, numel, (min(DIGEST_SIZE, numel),), generator=g)


def anchor_digest(anchor: torch.Tensor, indices: torch.Tensor) -> list[float]:
    """A few anchor values at fixed positions: enough to tell whether two anchors agree."""
    return anchor[indices].tolist()


def digest_spread(a: list[float], b: list[float]) -> float:
    """Relative distance between two anchor digests (0 = identical)."""
    ta, tb = torch.tensor(a), torch.tensor(b)
    if ta.shape != tb.shape:
        return math.inf
    return float((ta - tb).norm() / tb.norm().clamp_min(1e-12))
