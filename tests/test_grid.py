"""The rotating grid (Moshpit SGD): its keys, its re-indexing, and how fast it mixes (pure math)."""

from p2pdiloco import grid


def test_dims_cover_the_swarm():
    assert [grid.dims_for(n, 4) for n in (1, 4, 5, 16, 17, 64, 1024)] == [1, 1, 2, 2, 3, 3, 5]
    assert grid.dims_for(100, 1) == 1 and grid.dims_for(10**9, 2) == grid.MAX_DIMS


def test_one_dimension_is_one_group_with_the_plain_key():
    assert grid.key_bits([3], round_=5, dims=1, size=4) == ""


def test_a_line_shares_every_coordinate_but_the_free_one():
    a = grid.key_bits([0, 2, 1], round_=1, dims=3, size=4)   # free dimension 1
    assert a == grid.key_bits([0, 3, 1], round_=1, dims=3, size=4)
    assert a != grid.key_bits([1, 2, 1], round_=1, dims=3, size=4)
    assert a != grid.key_bits([0, 2, 1], round_=2, dims=3, size=4)   # another round, another dimension
    assert a != grid.key_bits([0, 2, 1], round_=1, dims=2, size=4)   # another grid never meets this one
    assert set(a) <= {"0", "1"}


def test_coords_are_stable_and_fit_a_new_shape():
    c = grid.initial_coords("QmPeer", 3, 4)
    assert c == grid.initial_coords("QmPeer", 3, 4) and all(0 <= x < 4 for x in c)
    assert grid.fit([1, 2], 3, 4, "QmPeer")[:2] == [1, 2]
    assert grid.fit([1, 2, 3], 1, 4, "QmPeer") == [1]


def _simulate(n: int, size: int, rounds: int) -> list[list[float]]:
    """Every peer's knowledge of every other peer's work (a matrix row per peer) after each round of a
    full, fault-free grid: a group's members leave with the mean of their rows."""
    dims = grid.dims_for(n, size)
    peers = [f"p{i:04d}" for i in range(n)]
    coords = {p: [int(d) for d in format(i, f"0{dims}d")] if size == 10 else
              [(i // size ** k) % size for k in range(dims)] for i, p in enumerate(peers)}
    know = {p: [float(i == j) for j in range(n)] for i, p in enumerate(peers)}
    history = []
    for r in range(rounds):
        lines = {}
        for p in peers:
            lines.setdefault(grid.key_bits(coords[p], round_=r, dims=dims, size=size), []).append(p)
        for members in lines.values():
            assert len(members) <= size
            mean = [sum(know[m][j] for m in members) / len(members) for j in range(n)]
            for index, m in enumerate(sorted(members)):
                know[m] = list(mean)
                coords[m] = grid.regroup(coords[m], round_=r, dims=dims, index=index)
        history.append(min(min(row) for row in know.values()))
    return history


def test_a_full_grid_mixes_everyone_in_log_g_n_rounds():
    """16 peers in groups of 4: after 2 rounds every anchor holds 1/16 of every peer's work."""
    assert _simulate(16, 4, 1)[-1] == 0.0
    assert abs(_simulate(16, 4, 2)[-1] - 1 / 16) < 1e-12
    assert abs(_simulate(64, 4, 3)[-1] - 1 / 64) < 1e-12


def _rounds(peers: list[str], dims: int, size: int, rounds: int, settle: bool) -> list[list[int]]:
    """Group sizes per round: hashed cells to start, lines capped at `size` as hivemind caps a group,
    re-indexing after each round, and (settle) each peer moving off a taken or outlying cell first,
    from the others' cells as their progress records show them."""
    coords = {p: grid.initial_coords(p, dims, size) for p in peers}
    sizes = []
    for r in range(rounds):
        if settle:
            cells = dict(coords)
            coords = {p: grid.settle(p, coords[p], {q: c for q, c in cells.items() if q != p}, live=len(peers),
                                     dims=dims, size=size, salt=r) for p in peers}
        lines = {}
        for p in peers:
            lines.setdefault(grid.key_bits(coords[p], round_=r, dims=dims, size=size), []).append(p)
        sizes.append([])
        for members in lines.values():
            for group in (members[i:i + size] for i in range(0, len(members), size)):
                sizes[-1].append(len(group))
                for index, m in enumerate(sorted(group)):
                    coords[m] = grid.regroup(coords[m], round_=r, dims=dims, index=index)
    return sizes


def test_settling_fills_the_grid_where_reindexing_alone_does_not():
    """16 and 12 peers on a 4 x 4 grid from hashed cells: re-indexing alone keeps groups of 1 and a
    mean under 3 for ever; settling onto free cells gives whole lines (4, or 3 and 4 with holes) from
    the second round on."""
    for n in (16, 12):
        peers = [f"peer{i}" for i in range(n)]
        alone = _rounds(peers, 2, 4, 8, settle=False)
        assert min(min(s) for s in alone[2:]) == 1 and max(sum(s) / len(s) for s in alone[2:]) < 3.3
        settled = _rounds(peers, 2, 4, 8, settle=True)
        assert all(min(s) >= 3 and max(s) <= 4 for s in settled[1:]), settled
    assert all(s == [4, 4, 4, 4] for s in _rounds([f"p{i}" for i in range(16)], 2, 4, 8, settle=True)[1:])


def test_a_thousand_peers_settle_into_lines():
    """1,000 peers, target 16: 3 dimensions of side 10, and groups of 10 once settled."""
    assert grid.side(1000, grid.dims_for(1000, 16), 16) == 10
    sizes = _rounds([f"peer{i}" for i in range(1000)], 3, 16, 6, settle=True)
    assert all(s == 10 for s in sizes[-1]), sizes[-1]
