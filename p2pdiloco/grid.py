"""Groups beyond one: a swarm larger than `target_group_size` averages in small groups on a
rotating grid, so that every peer's work reaches every anchor within a few rounds.

This is Moshpit SGD's grid (Ryabinin et al., arXiv 2103.03239, Algorithm 1). Every peer holds
coordinates on a grid of `dims` = ceil(log_size N) dimensions (size = target_group_size), of which
the live peers fill the first N cells of `sides(N)` (each <= size, about N**(1/dims): the grid of the
fewest cells that holds N, in lines as even as they can be; 256 at size 8 is 8 x 8 x 4). In round
r the peers that share every coordinate except the one of dimension k = r mod dims meet: a group is
a line of the grid. After the round the members deal out again, in order of peer id, the coordinates k
they held (`reindex`), so the next round's lines (along dimension k+1) each hold one member of every
line of this round. On a full grid, information from every peer reaches every anchor in `dims` rounds.
Re-indexing alone does not keep the lines full (hashed cells collide for ever); `settle` moves a
peer off a taken or outlying cell, by the cells in the other peers' progress records.

    >>> dims = dims_for(16, 4)                       # 2: a 4 x 4 grid
    >>> coords = initial_coords("QmPeer", dims, 4)   # a stable hash of the peer id
    >>> bits = key_bits(coords, round_=7, dims=dims, size=4)   # the averager's group key bits
    >>> coords = reindex(coords, round_=7, dims=dims, size=4, me="QmPeer", cells=group_cells)  # after a group

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

import functools
import hashlib
import math

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


def place(me: str, peers, *, dims: int, size: int) -> list[int]:
    """A peer's first cell: its rank among the live peers it knows of (sorted peer ids, from the progress
    records), as the digits of the grid of sides(N). Founders that read the same records
    fill the grid's first N cells with no collision and no hole; a peer whose view differs from the
    others' is moved by `settle` later, as a hashed cell would be. Hashed cells at 256 peers left lines
    fragmented until records carrying the cells were read, 64 s and 5 periods later."""
    ids = sorted(set(peers) | {me})
    return _digits(ids.index(me), sides(len(ids), dims, size))


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


def fit(coords: list[int], dims: int, size: int, peer_id: str, peers=()) -> list[int]:
    """Coordinates for a grid of `dims` dimensions: ours if they have that shape, else (a first cell, or
    the grid grew or shrank) our place by rank among the live peers we know of (`place`), or a hash of
    our id if we know of none (a rank among one would be cell 0 for every such peer)."""
    if len(coords) == dims:
        return [min(c, size - 1) for c in coords]
    if set(peers) - {peer_id}:
        return place(peer_id, peers, dims=dims, size=size)
    return initial_coords(peer_id, dims, size)


@functools.lru_cache(maxsize=256)
def sides(live: int, dims: int, size: int) -> tuple[int, ...]:
    """Cells per dimension in use (each <= size, the first the longest): the grid of the fewest cells that
    holds `live` peers, of the most even lines among those. 256 peers at target 8 get 8 x 8 x 4, every line
    whole, where the same side in every dimension gives 7 x 7 x 7 with 87 cells empty: lines of 1 in the
    last layer, and every peer's work in every anchor rounds later than ceil(log_g N) (the simulation: 5
    rounds against 3)."""
    best = None

    def walk(prefix: tuple, cap: int) -> None:
        nonlocal best
        if len(prefix) == dims:
            cells = math.prod(prefix)
            if cells >= live:
                key = (cells, -min(prefix))
                if best is None or key < best[0]:
                    best = (key, prefix)
            return
        for v in range(cap, 0, -1):
            if math.prod(prefix) * v ** (dims - len(prefix)) < live:
                break  # every later v is smaller: too few cells
            walk(prefix + (v,), v)

    walk((), max(1, size))
    return best[1] if best else (max(1, size),) * dims


def cell_index(coords: list[int], radix) -> int:
    """The cell's number: coordinates as digits of base `radix` (one base, or one per dimension), the first
    the lowest."""
    bases = [radix] * len(coords) if isinstance(radix, int) else list(radix)
    index, weight = 0, 1
    for c, b in zip(coords, bases):
        index, weight = index + c * weight, weight * b
    return index


def _digits(index: int, bases) -> list[int]:
    out = []
    for b in bases:
        out.append(index % b)
        index //= b
    return out


def _inside(coords: list[int], bases) -> bool:
    return len(coords) == len(bases) and all(0 <= c < b for c, b in zip(coords, bases))


def settle(me: str, coords: list[int], cells: dict[str, list[int]], *, live: int, dims: int, size: int,
           salt: int = 0) -> list[int]:
    """Our cell, given the other live peers' cells in this round (from their progress records).

    Re-indexing alone does not fill the grid: hashed cells leave lines of one, and lines of more
    than `size` (two peers in one cell stay together for ever): 12 peers on a 4 x 4 grid met in
    groups of 2.4 on average, in a simulation. Here a peer whose cell a smaller peer id also holds,
    or whose cell lies outside the first `live` cells of the grid of sides(live), moves
    to a free cell among those (picked by a hash of its id and `salt`, so that movers spread out;
    two that pick the same cell settle at the next look).
    """
    bases = sides(live, dims, size)
    inside = list(coords[:dims])
    mine = cell_index(inside, bases) if _inside(inside, bases) else None
    taken = {cell_index(c, bases) for peer, c in cells.items() if peer < me and _inside(c, bases)}
    cap = math.prod(bases)
    limit = min(max(live, 1), cap)
    if mine is not None and mine not in taken and mine < limit:
        return coords
    everyone = taken | {cell_index(c, bases) for c in cells.values() if _inside(c, bases)}
    free = [i for i in range(limit) if i not in everyone] or [i for i in range(cap) if i not in everyone]
    if not free:
        return coords
    pick = int.from_bytes(hashlib.blake2b(f"{me}:{salt}".encode(), digest_size=8).digest(), "big") % len(free)
    return _digits(free[pick], bases)


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


def line_size(coords: list[int], *, round_: int, dims: int, size: int, live: int) -> int:
    """How many of the cells the live peers fill (the first `live` of the grid of sides(live))
    lie on our line of round `round_`: the group that holds every one of them is a whole line. A grid
    of N < its cells has short lines too (300 peers on 8 x 8 x 5: the last layer holds 44 of 64 cells,
    a line along dimension 2 holds 4 or 5 and one along dimension 0 in that layer may hold 4). A line
    outside that part of the grid (a cell not settled yet) counts the line's whole side."""
    bases = sides(live, dims, size)
    if not _inside(list(coords[:dims]), bases):
        return bases[dimension(round_, dims)]
    k = dimension(round_, dims)
    on_line = [[*coords[:k], v, *coords[k + 1:dims]] for v in range(bases[k])]
    return sum(cell_index(c, bases) < live for c in on_line) or bases[k]


def reindex(coords: list[int], *, round_: int, dims: int, size: int, me: str, cells: dict) -> list[int]:
    """After a formed group of round `round_` (member peer id -> the cell it entered with, from the
    round's gather): the coordinates the members held along the free dimension, dealt out again in
    order of peer id, so that the next lines each hold one member of this one (Moshpit's re-indexing).

    Dealing out the cells the members held, not 0..g-1 (their index in the group), leaves the cells
    taken the same after a group that missed a member (frozen, late, in another phase) or split in
    two: the absent member keeps its cell and nobody lands on it, and no cell of the line empties.
    Index-in-group made both, and at 256 peers the collisions and holes outran the settling by stale
    progress records (whole lines in 0.39 of rounds, in the simulation). Two members that held one
    coordinate (a collision) still part, as with the index: the second takes the lowest coordinate no
    member held (a line's used cells are its lowest ones). A member whose cell the gather does not
    carry (an older peer) leaves everyone's coordinates as they were."""
    k = dimension(round_, dims)
    held = []
    for cell in cells.values():
        if not valid_cell(cell, dims, size):
            return list(coords[:dims])
        held.append(cell[k])
    ids = sorted(cells)
    if me not in ids:
        return list(coords[:dims])
    free = iter(v for v in range(size) if v not in set(held))
    dealt, seen = [], set()
    for v in sorted(held):
        dealt.append(v if v not in seen else next(free, v))
        seen.add(v)
    out = list(coords[:dims])
    out[k] = sorted(dealt)[ids.index(me)]
    return out
