"""Robust aggregation of one part of a round, and the check that a reducer computed it honestly.

CenteredClip (Karimireddy et al., arXiv 2012.10333; run per reducer part as BTARD's
"ButterflyClip", Gorbunov et al., arXiv 2106.11257): start at the coordinate-wise median v of the
senders' parts g_i, then repeat

    v <- v + sum_i w_i (g_i - v) * min(1, tau / |g_i - v|) / sum_i w_i

Here tau is not a constant to tune: at every iteration it is the (lower) median of the senders'
distances |g_i - v| (with two senders or fewer, the plain weighted mean: tau = inf), so at least
half of the senders are never clipped and a sender far from the others pulls v by at most tau (a
weighted share of it). At the fixed point v*,

    sum_i w_i (g_i - v*) * min(1, tau* / |g_i - v*|) = 0,    tau* = median_i |g_i - v*|,

which every member can check for its own term once the others publish theirs: each member knows
its part g_i, the average v* it received and its weight; the distances |g_i - v*| give tau*. A
random unit vector z, drawn after the reducer sent its result from nonces the reducer does not
control, turns each member's term into one number (`fixed_point_terms`); the terms must sum to
about zero. A reducer that returned anything else than a fixed point is caught unless its lie is
tiny next to tau (BTARD's random-projection check, simplified: no commitments; see
docs/security.md for what that leaves open).

Pure math on CPU tensors, no network: the reducer (allreduce.py) and the round's check
(averaging.py) call it.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

import torch

# Most parts converge in 3-8 iterations. Senders that hold the same values (members of one earlier group
# offering their anchor in a merge round) pull v onto them only geometrically (~3% an iteration, as tau
# shrinks with them): after 50 iterations the fixed-point residual was still 0.08-0.13 of the check's
# scale and honest reducers failed the check (16 paced peers, docs/scale.md); after 200, 0.0004
MAX_ITERATIONS = 200
TOLERANCE = 1e-5       # stop once an iteration moves v by less than this times tau
PROJECTIONS = 2        # random directions per part in the reducer check
CHECK_THRESHOLD = 0.1  # |sum of terms| / sqrt(sum of squared terms) above this: the reducer lied
# ... where the terms are at least this fraction of the average's own size: members that all hold
# the same values (a merge round's anchors) leave terms of fp32 rounding noise, whose ratio means nothing.
# fp16 transport rounds each part by ~1e-4 of its size (rms), which moves the sum of the terms by about
# that much: at 1e-3, two members whose first pseudo-gradients differed by ~4e-3 of their size (AdamW's
# first steps barely depend on the data) made an honest reducer fail the check (statistic 0.126, CI)
CHECK_FLOOR = 1e-2
# ... and below fp16's smallest normal value (2^-14) fp16 rounds by a fixed 2^-25, not by 2^-11 of the value:
# an average this small is floored as if it were this size. Pseudo-gradients of ~4e-6 (the 85M preset's first
# rounds at a small H, deep in a 1000-step warmup) made two honest peers fail the check (statistic 0.11-0.70)
# in every round and ban each other (tests/test_averaging.py, "below fp16's normal range")
FP16_MIN_NORMAL = 2.0 ** -14
MEDIAN_NETWORK_ROWS = 64  # more senders than this: torch's median (a network of 64 is 543 comparators)
HARD_CLIP = 0.5        # a sender scaled below this (its distance over 2 tau) was clipped hard
WEIGHT_RATIO = 1.5     # with a robust rule, a sender's weight is capped at this times the group's median


def tau_of(distances: list) -> float:
    """tau at the fixed point, from the distances of the senders that took part (finite ones)."""
    finite = [d for d in distances if d == d and d != float("inf")]
    return lower_median(torch.tensor(finite)) if len(finite) > 2 else float("inf")


@dataclass
class Clipped:
    """One part's robust average and, per sender, the factor its deviation was scaled by (1 = not clipped)."""

    average: torch.Tensor
    scales: list
    tau: float
    iterations: int


def lower_median(values: torch.Tensor) -> float:
    """The lower median (of two, the smaller), as the norm filter's (allreduce._lower_median)."""
    return float(values.sort().values[(values.numel() - 1) // 2]) if values.numel() else 0.0


def centered_clip(parts: torch.Tensor, weights: torch.Tensor) -> Clipped:
    """CenteredClip of `parts` (senders x values, fp32) with `weights` (senders); senders with weight 0
    take no part. Returns the fixed point and how hard each sender was clipped there."""
    used = weights > 0
    scales = [1.0] * len(weights)
    if not bool(used.any()):
        return Clipped(torch.zeros(parts.shape[1]), scales, 0.0, 0)
    g, w = parts[used].float(), weights[used].float()
    w = w / w.sum()
    if len(g) <= 2:  # two senders: nothing tells which one is wrong; the median would pick the heavier
        return Clipped((w[:, None] * g).sum(0), scales, float("inf"), 0)
    v = coordinate_median(g).clone()
    diff = g - v  # one buffer of the parts' size, reused: the distances and the step both read it
    dist = diff.norm(dim=1)
    tau, it = 0.0, 0
    for it in range(1, MAX_ITERATIONS + 1):
        tau = lower_median(dist)
        factor = torch.where(dist > tau, tau / dist.clamp_min(1e-30), torch.ones_like(dist))
        step = torch.mv(diff.t(), w * factor)
        v.add_(step)
        torch.sub(g, v, out=diff)
        dist = diff.norm(dim=1)
        if float(step.norm()) <= TOLERANCE * max(tau, 1e-30):
            break
    tau = lower_median(dist)
    factor = torch.where(dist > tau, tau / dist.clamp_min(1e-30), torch.ones_like(dist))
    for index, f in zip(used.nonzero().flatten().tolist(), factor.tolist()):
        scales[index] = f
    return Clipped(v, scales, tau, it)


def coordinate_median(g: torch.Tensor) -> torch.Tensor:
    """The coordinate-wise lower median of the rows of g, as g.median(dim=0).values, 4-8x faster for
    the few rows of a group (3-16): Batcher's odd-even merge sort as elementwise min/max of whole rows
    (torch's median sorts each column on its own: 13 ms of a 3-sender part's ~30, scripts/robust_cost.py)."""
    n = g.shape[0]
    if n > MEDIAN_NETWORK_ROWS:
        return g.median(dim=0).values
    size = 1 << (n - 1).bit_length()
    rows: list = [*g.unbind(0), *[None] * (size - n)]  # None: a row of +inf, padding to a power of 2
    for i, j in _batcher_pairs(size):
        if rows[j] is None:
            continue
        if rows[i] is None:
            rows[i], rows[j] = rows[j], None
        else:
            rows[i], rows[j] = torch.minimum(rows[i], rows[j]), torch.maximum(rows[i], rows[j])
    return rows[(n - 1) // 2]


@functools.lru_cache(maxsize=None)
def _batcher_pairs(size: int) -> tuple:
    """The comparators (i < j) of Batcher's odd-even merge sort of `size` (a power of 2) values."""
    pairs = []
    p = 1
    while p < size:
        k = p
        while k >= 1:
            for j in range(k % p, size - k, 2 * k):
                for i in range(min(k, size - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p):
                        pairs.append((i + j, i + j + k))
            k //= 2
        p *= 2
    return tuple(pairs)


@dataclass
class Directions:
    """`count` random directions over `length` values, each the Kronecker product a_i (x) b_i of two
    Gaussian vectors of about sqrt(length) values (unit norm each, the product trimmed to length).
    Drawing two full Gaussian vectors per part cost more than the rest of the check: 177M normals a
    round at 88.6M parameters, ~1 s of one idle core (scripts/robust_cost.py), several under load.
    a (x) b needs 2 sqrt(length) of them, and <x, a (x) b> = a^T X b (X: x as a p x q matrix) is one
    pass over x. For any error e != 0, a^T E b is a nonzero polynomial in Gaussians, so a lie that
    the reducer fixed before the directions were drawn projects to zero with probability 0, as with
    dense Gaussian directions (its density near 0 is a little higher: a product of two normals for a
    rank-1 error); Rademacher signs, as cheap, would let a lie of two opposite values pass half the
    time. Such directions are the rows of a Khatri-Rao random projection (arXiv 2507.23207; tensorized
    random projections, Rakhshan and Rabusseau, arXiv 2110.13970)."""

    a: torch.Tensor  # count x p
    b: torch.Tensor  # count x q, p * q >= length
    length: int

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """<x, a_i (x) b_i> for every direction i (x: `length` values)."""
        p, q = self.a.shape[1], self.b.shape[1]
        x = x.reshape(-1).float()
        if x.numel() != p * q:
            x = torch.nn.functional.pad(x, (0, p * q - x.numel()))
        return ((x.view(p, q) @ self.b.t()).t() * self.a).sum(1)

    def dense(self) -> torch.Tensor:
        """The directions as count x length vectors (tests)."""
        count = self.a.shape[0]
        return (self.a[:, :, None] * self.b[:, None, :]).reshape(count, -1)[:, :self.length]


def directions(seed: bytes, length: int, count: int = PROJECTIONS) -> Directions:
    """`count` random directions over `length` values, the same on every member for the same seed."""
    generator = torch.Generator().manual_seed(int.from_bytes(hashlib.blake2b(seed, digest_size=8).digest(), "big")
                                              >> 1)
    q = max(1, math.isqrt(max(0, length - 1)) + 1)  # ceil(sqrt(length))
    p = max(1, -(-length // q))
    a, b = torch.randn(count, p, generator=generator), torch.randn(count, q, generator=generator)
    return Directions(a / a.norm(dim=1, keepdim=True), b / b.norm(dim=1, keepdim=True), length)


def check_seed(group_id: str, part: int, nonces: dict, reducer: str) -> bytes:
    """The seed of a part's check directions: the group, the part and every member's nonce but the
    reducer's own (published after the member received its average, so the reducer cannot know them
    when it answers, nor steer them)."""
    others = ",".join(f"{peer}:{nonce}" for peer, nonce in sorted(nonces.items()) if peer != reducer)
    return f"{group_id}/{part}/{others}".encode()


def fixed_point_terms(own: torch.Tensor, average: torch.Tensor, weight: float, tau: float,
                      z: Directions) -> list:
    """This member's term of the fixed-point condition, projected on each direction in z:
    w * <g - v, z> * min(1, tau / |g - v|). tau = inf checks a plain weighted mean."""
    diff = own.float() - average.float()
    dist = float(diff.norm())
    factor = 1.0 if dist <= tau else tau / dist
    return (z.project(diff) * (weight * factor)).tolist()


def check_floor(average: torch.Tensor, total_weight: float) -> float:
    """The smallest scale of a piece's terms that the check trusts: a lie of CHECK_FLOOR of the
    average's size (its rms, at least FP16_MIN_NORMAL) would move the sum of the terms by about this much."""
    rms = float(average.float().norm()) / max(1, average.numel()) ** 0.5
    return CHECK_FLOOR * max(rms, FP16_MIN_NORMAL) * total_weight


def check_statistic(terms: list, floor: float = 0.0) -> float:
    """|sum| / sqrt(sum of squares) of the members' projected terms (each a list over directions),
    the largest over directions: ~0 at a fixed point, up to sqrt(members) for a lie. The scale is
    at least `floor` (check_floor)."""
    worst = 0.0
    for values in zip(*terms):
        values = torch.tensor(values, dtype=torch.float64)
        scale = max(float(values.square().sum().sqrt()), floor)
        if scale > 0:
            worst = max(worst, abs(float(values.sum())) / scale)
    return worst
