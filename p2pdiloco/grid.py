"""Groups beyond one: a swarm larger than `target_group_size` averages in small groups on a
rotating grid, so that every peer's work reaches every anchor within a few rounds.

This is Moshpit SGD's grid (Ryabinin et al., arXiv 2103.03239, Algorithm 1). Every peer holds
coordinates on a grid of `dims` = ceil(log_size N) dimensions (size = target_group_size), of which
the live peers fill the first N cells of side(N) <= size per dimension, about N**(1/dims). In round
r the peers that share every coordinate except the one of dimension k = r mod dims meet: a group is
a line of the grid. After the round each member takes its index in the group as its new
coordinate k, so the next round's lines (along dimension k+1) each hold one member of every line
of this round. On a full grid, information from every peer reaches every anchor in `dims` rounds.
Re-indexing alone does not keep the lines full (hashed cells collide for ever); `settle` moves a
peer off a taken or outlying cell, by the cells in the other peers' progress records.

    >>> dims = dims_for(16, 4)                       # 2: a 4 x 4 grid
    >>> coords = initial_coords("QmPeer", dims, 4)   # a stable hash of the peer id
    >>> bits = key_bits(coords, round_=7, dims=dims, size=4)   # the averager's group key bits
    >>> coords = regroup(coords, round_=7, dims=dims, index=2)  # we were member 2 of the group

`dims` and `round_` must agree across the swarm: they travel with the schedule (schedule.Clock:
a formed group agrees on them as it agrees on the next due time, and a peer out of phase takes them
from the progress records). With dims = 1 (the swarm fits in one group) the key is the same for
everyone: one group, as without a grid. hivemind 1.1.12 re-buckets a peer itself after every
assembled group (`GroupKeyManager.update_key_on_group_assembled`: it shifts the key's bits by
log2(target_group_size) random ones), which would move a peer off the grid's key after its first
group; the averager (averaging.DilocoAverager) turns that off, and the key is the grid's alone. A
random re-bucketing also leaves the buckets unbalanced once N > size**2, which the grid does not.
"""

from __future__ import annotations

import hashlib

MAX_DIMS = 15  # 4 bits of the key: up to size**15 peers


def dims_for(swarm_size: int, size: int) -> int:
    """The grid's dimensions for a swarm of this many live peers: the fewest d with size**d >= N."""
    if size < 2:
        return 1
    dims, cells = 1, size
    while cells < swarm_size and dims < MAX_DIMS:
        dims, cells = dims + 1, cells * size
    return dims


def _bits(size: int) -> int:
    return max(1, (size - 1).bit_length())


def initial_coords(peer_id: str, dims: int, size: int) -> list[int]:
    """A joiner's cell: a stable hash of its peer id (blake2b, the same on every run)."""
    digest = hashlib.blake2b(peer_id.encode(), digest_size=2 * MAX_DIMS).digest()
    return [int.from_bytes(digest[2 * i:2 * i + 2], "big") % max(1, size) for i in range(dims)]


def valid_cell(cell, dims: int, size: int) -> bool:
    """A cell as another peer's progress record may carry it (anything else is ignored)."""
    return (isinstance(cell, list) and len(cell) == dims
            and all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c < size for c in cell))


def cells_of(records: dict, *, me: str, round_: int, dims: int, size: int) -> dict[str, list[int]]:
    """The other peers' cells in this round, from their progress records (peer id -> record with
    `round`, `dims` and `cell`): records of another round or grid shape say nothing of this one."""
    return {peer: r["cell"] for peer, r in records.items()
            if peer != me and r.get("round") == round_ and r.get("dims") == dims
            and valid_cell(r.get("cell"), dims, size)}


def fit(coords: list[int], dims: int, size: int, peer_id: str) -> list[int]:
    """Coordinates for a grid of `dims` dimensions: ours where we have them, hashed for new ones."""
    fresh = initial_coords(peer_id, dims, size)
    return [min(c, size - 1) for c in coords[:dims]] + fresh[len(coords[:dims]):]


def side(live: int, dims: int, size: int) -> int:
    """Cells per dimension in use: the fewest s <= size with s**dims >= live (lines of about
    live**(1/dims) peers in every dimension, not full lines in the first ones and a sparse last one)."""
    s = 1
    while s < size and s ** dims < live:
        s += 1
    return max(s, 1)


def cell_index(coords: list[int], radix: int) -> int:
    """The cell's number: coordinates as digits of base `radix`, the first the lowest."""
    return sum(c * radix ** i for i, c in enumerate(coords))


def settle(me: str, coords: list[int], cells: dict[str, list[int]], *, live: int, dims: int, size: int,
           salt: int = 0) -> list[int]:
    """Our cell, given the other live peers' cells in this round (from their progress records).

    Re-indexing alone does not fill the grid: hashed cells leave lines of one, and lines of more
    than `size` (two peers in one cell stay together for ever): 12 peers on a 4 x 4 grid met in
    groups of 2.4 on average, in a simulation. Here a peer whose cell a smaller peer id also holds,
    or whose cell lies outside the first `live` cells of a grid of side(live) per dimension, moves
    to a free cell among those (picked by a hash of its id and `salt`, so that movers spread out;
    two that pick the same cell settle at the next look).
    """
    s = side(live, dims, size)
    inside = list(coords[:dims])
    mine = cell_index(inside, s) if len(inside) == dims and all(c < s for c in inside) else None
    taken = {cell_index(c, s) for peer, c in cells.items() if peer < me and len(c) == dims and all(x < s for x in c)}
    limit = min(max(live, 1), s ** dims)
    if mine is not None and mine not in taken and mine < limit:
        return coords
    everyone = taken | {cell_index(c, s) for c in cells.values() if len(c) == dims and all(x < s for x in c)}
    free = [i for i in range(limit) if i not in everyone] or [i for i in range(s ** dims) if i not in everyone]
    if not free:
        return coords
    pick = int.from_bytes(hashlib.blake2b(f"{me}:{salt}".encode(), digest_size=8).digest(), "big") % len(free)
    return [(free[pick] // s ** i) % s for i in range(dims)]


def dimension(round_: int, dims: int) -> int:
    """The dimension along which round `round_` groups peers."""
    return round_ % dims


def key_bits(coords: list[int], *, round_: int, dims: int, size: int) -> str:
    """The group key's bits for round `round_`: the grid's shape (dims), the free dimension, and our
    coordinates in every other dimension. Peers with equal bits meet (hivemind's bucket). With one
    dimension there is one line: no bits, the key of a swarm without a grid."""
    if dims <= 1:
        return ""
    k = dimension(round_, dims)
    width = _bits(size)
    others = "".join(format(c, f"0{width}b") for i, c in enumerate(coords[:dims]) if i != k)
    return format(dims, "04b") + format(k, "04b") + others


def regroup(coords: list[int], *, round_: int, dims: int, index: int) -> list[int]:
    """After a formed group of round `round_`: our coordinate along its free dimension becomes our
    index among the members (sorted by peer id, the same order on every member)."""
    out = list(coords[:dims])
    out[dimension(round_, dims)] = index
    return out
