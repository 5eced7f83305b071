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
    assert grid.fit([1, 2, 3], 3, 4, "QmPeer") == [1, 2, 3]
    # a new shape: a new cell, our rank among the peers we know of, or (none) the hash
    assert grid.fit([1, 2], 3, 4, "QmPeer") == c and grid.fit([1, 2, 3], 1, 4, "QmPeer", ["QmA", "QmZ"]) == [1]
    assert grid.fit([], 3, 4, "QmPeer", {"QmPeer"}) == c


def _deal(coords: dict, members: list, round_: int, dims: int, size: int) -> None:
    """A formed group's members re-index (grid.reindex), each from the cells they all entered with."""
    cells = {m: list(coords[m]) for m in members}
    for m in members:
        coords[m] = grid.reindex(cells[m], round_=round_, dims=dims, size=size, me=m, cells=cells)


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
            for m in members:
                know[m] = list(mean)
            _deal(coords, members, r, dims, size)
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
                _deal(coords, group, r, dims, size)
    return sizes


def test_settling_fills_the_grid_where_reindexing_alone_does_not():
    """16 and 12 peers on a 4 x 4 and a 4 x 3 grid from hashed cells: re-indexing alone keeps groups of 1
    or 2 and a mean under 3.3 for ever (two members of one cell part, but a line's empty cells stay
    empty); settling onto free cells gives whole lines (4, or 3 and 4 with holes) from the second round on."""
    for n in (16, 12):
        peers = [f"peer{i}" for i in range(n)]
        alone = _rounds(peers, 2, 4, 8, settle=False)
        assert min(min(s) for s in alone[2:]) <= 2 and max(sum(s) / len(s) for s in alone[2:]) < 3.3
        settled = _rounds(peers, 2, 4, 8, settle=True)
        assert all(min(s) >= 3 and max(s) <= 4 for s in settled[1:]), settled
    # here two movers picked one free cell in the first round: whole lines from the third (a collision split
    # across two groups is not parted by re-indexing, only by the next settle)
    assert all(s == [4, 4, 4, 4] for s in _rounds([f"p{i}" for i in range(16)], 2, 4, 8, settle=True)[2:])


def test_a_thousand_peers_settle_into_lines():
    """1,000 peers, target 16: 3 dimensions of side 10, and groups of 10 once settled."""
    assert grid.sides(1000, grid.dims_for(1000, 16), 16) == (10, 10, 10)
    sizes = _rounds([f"peer{i}" for i in range(1000)], 3, 16, 6, settle=True)
    assert all(s == 10 for s in sizes[-1]), sizes[-1]


def test_reindexing_deals_out_the_cells_the_members_held():
    """A group of 3 on a line of 4 (the member of coordinate 2 absent): the members' coordinates 0, 1
    and 3 go round in order of peer id, so the absent member's 2 stays its own and nothing collides; two
    members of one cell part (the second takes the lowest coordinate nobody held); a member's cell
    missing from its gather, or of another grid, leaves everyone where they were."""
    cells = {"c": [3, 1], "a": [1, 1], "b": [0, 1]}   # round 0 of 2 dimensions: dimension 0 is free
    dealt = {m: grid.reindex(cells[m], round_=0, dims=2, size=4, me=m, cells=cells) for m in cells}
    assert dealt == {"a": [0, 1], "b": [1, 1], "c": [3, 1]}
    cells = {"a": [2, 0], "b": [2, 0], "c": [0, 0]}   # a and b collide on cell (2, 0): b takes 1
    dealt = {m: grid.reindex(cells[m], round_=2, dims=2, size=4, me=m, cells=cells) for m in cells}
    assert sorted(d[0] for d in dealt.values()) == [0, 1, 2] and all(d[1] == 0 for d in dealt.values())
    for odd in (None, [1], [9, 0], [True, 0], "cell"):
        assert grid.reindex([2, 0], round_=0, dims=2, size=4, me="a", cells={"a": [2, 0], "b": odd}) == [2, 0]
    assert grid.reindex([2, 0], round_=0, dims=2, size=4, me="z", cells={"a": [1, 0]}) == [2, 0]


def test_a_grid_holds_its_peers_in_the_fewest_cells_and_a_line_the_used_ones():
    """256 peers, target 8: 8 x 8 x 4, every line whole (7 x 7 x 7 left lines of 1); 300 peers: 8 x 8 x 5,
    whose last layer holds 44 of 64 cells. A line outside the used part (a cell not settled) counts its side."""
    assert grid.sides(256, 3, 8) == (8, 8, 4) and grid.sides(1024, 4, 8) == (8, 8, 4, 4)
    assert grid.sides(16, 2, 4) == (4, 4) and grid.sides(12, 2, 4) == (4, 3) and grid.sides(2, 1, 8) == (2,)
    assert all(grid.line_size([1, 2, 3], round_=r, dims=3, size=8, live=256) == (8, 8, 4)[r] for r in range(3))
    assert grid.sides(300, 3, 8) == (8, 8, 5)
    assert grid.line_size([0, 0, 0], round_=2, dims=3, size=8, live=300) == 5    # cells 0, 64, ..., 256
    assert grid.line_size([7, 7, 0], round_=2, dims=3, size=8, live=300) == 4    # 63, ..., 255; 319 is not used
    assert grid.line_size([0, 5, 4], round_=0, dims=3, size=8, live=300) == 4    # cells 296-299
    assert grid.line_size([0, 6, 4], round_=0, dims=3, size=8, live=300) == 8    # not settled yet: the side
    assert grid.line_size([0, 0, 5], round_=0, dims=3, size=8, live=300) == 8
    assert grid.cell_index([1, 2, 3], (8, 8, 5)) == 1 + 2 * 8 + 3 * 64 and grid.cell_index([1, 2], 4) == 9
    # founders that read the same records take the first N cells, one each
    ids = [f"Qm{i:03d}" for i in range(256)]
    cells = {tuple(grid.place(p, ids, dims=3, size=8)) for p in ids}
    assert len(cells) == 256 and all(grid.cell_index(list(c), (8, 8, 4)) < 256 for c in cells)
    assert grid.fit([], 3, 8, "Qm007", ids) == grid.place("Qm007", ids, dims=3, size=8) == [7, 0, 0]
