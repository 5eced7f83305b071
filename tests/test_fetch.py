"""Shards fetched from peers (data/fetch.py), with real peers on loopback: a peer that holds only
the manifest trains on shards it fetches into a bounded cache, checked against their sha256; a
shard that no live peer holds is not read until a holder comes; a holder whose bytes are corrupt
is caught by the checksum, reported once, and the shard comes from the other holder."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from p2pdiloco.data.manifest import copy_manifest, file_sha256, read_manifest
from p2pdiloco.data.prepare import prepare
from p2pdiloco.localswarm import LocalSwarm
from tests.conftest import TINY, make_corpus

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """15 units of ~100 KB of text as bytes: train shards of ~1,000 windows (seconds a slot) and
    held-out shards of ~60 KB (two chunks of a fetch, so that two holders both serve each)."""
    root = tmp_path_factory.mktemp("fetch")
    corpus = make_corpus(root / "corpus.txt", size=1_500_000, seed=5)
    prepare([str(corpus)], root / "tokens", tokenizer="bytes", shard_mb=0.1, eval_fraction=0.3, workers=1,
            progress=lambda _: None)
    return root / "tokens"


def caches(root: Path):
    """--shard-cache under the test's directory: the default (~/.cache, keyed by the manifest's digest,
    the same in every run of this test) would carry shards fetched in one run into the next."""
    return lambda name: ["--shard-cache", str(root / f"{name}-cache")]


def peer_id(swarm, name) -> str:
    return swarm.events(name, "inner")[0]["peer"]


def fetches(swarm, name, ok=True):
    return [e for e in swarm.events(name, "fetch") if e["ok"] is ok]


def read_shards(swarm, *names) -> set[int]:
    return {r["shard"] for n in names for r in swarm.events(n, "data")}


def check_cache(cache: Path, manifest) -> list[str]:
    """Every file in the cache is a whole shard of the manifest."""
    sha = {s.file: s.sha256 for s in manifest.train + manifest.val}
    files = [f for f in cache.iterdir() if f.is_file()]
    assert all(f.name in sha and file_sha256(f) == sha[f.name] for f in files), [f.name for f in files]
    return [f.name for f in files]


def test_a_peer_with_only_the_manifest_trains_on_shards_from_peers(tmp_path, tokens):
    """a holds every shard but two; c holds only the manifest, with a cache of a few shards. c
    fetches the held-out shards and the train shards it claims from a and trains; nobody reads the
    two shards until b, who holds them, joins; the cache never holds more than its bound."""
    manifest = read_manifest(tokens)
    a_data = tmp_path / "a-data"
    shutil.copytree(tokens, a_data)
    unheld = {1, 2}
    for i in unheld:
        (a_data / manifest.train[i].file).unlink()
    c_data, cache = copy_manifest(tokens, tmp_path / "c-data"), tmp_path / "c-cache"
    val_bytes = sum(s.tokens * 2 for s in manifest.val)
    shard_bytes = max(s.tokens * 2 for s in manifest.train)
    limit = val_bytes + 3 * shard_bytes + 1000  # room for the held-out split and three train shards
    args = ["--inner-steps", "20", "--state-timeout", "10"]
    cache_of = caches(tmp_path)
    with LocalSwarm(tmp_path, config=TINY, extra_args=args) as swarm:
        swarm.start("a", "--data", str(a_data), *cache_of("a"))
        swarm.wait_for(lambda: swarm.events("a", "inner"), timeout=60, what="a training")
        swarm.start("c", "--data", str(c_data), "--shard-cache", str(cache), "--shard-cache-gb", str(limit / 2**30),
                    "--shards-per-peer", "1", join="a")
        # c reads shard after shard, each fetched first, the oldest evicted once the train shards fetched outgrow
        # the room (shards differ in size: once in CI the five c claimed filled three of the largest to the byte)
        size = {s.file: s.tokens * 2 for s in manifest.train}
        room = limit - val_bytes

        def fetched_train_bytes() -> int:
            return sum(size.get(name, 0) for name in {f["shard"] for f in fetches(swarm, "c")})
        swarm.wait_for(lambda: fetched_train_bytes() > room and swarm.events("c", "outer"), timeout=120,
                       what="c fetching more train shards than fit in its cache, and averaging")
        held = check_cache(cache, manifest)
        assert sum((cache / f).stat().st_size for f in held) <= limit
        assert any(f.get("evicted") for f in fetches(swarm, "c")), "the cache never let a shard go"
        assert {s.file for s in manifest.val} <= set(held), "c dropped a held-out shard"
        # every fetch came from a (the only holder); nobody read what nobody holds
        assert all(set(f["bytes"]) == {peer_id(swarm, "a")} for f in fetches(swarm, "c")), fetches(swarm, "c")
        assert not read_shards(swarm, "a", "c") & unheld
        assert swarm.events("c", "inner")[-1]["data"]["shards"] == len(manifest.train)

        swarm.start("b", "--data", str(tokens), *cache_of("b"), join="a")
        swarm.wait_for(lambda: read_shards(swarm, "a", "b", "c") & unheld, timeout=90,
                       what="an unheld shard read once its holder came")
        assert "Traceback" not in swarm.stderr("c", tail=1 << 20)


def test_a_holder_serving_corrupted_bytes_is_caught_and_the_shard_comes_from_another(tmp_path, tokens):
    """a and b hold copies; b's copy of one held-out shard rots after b checked it at start. c,
    with the manifest only, fetches every held-out shard from both; the rotten one fails its
    sha256, b is named once and never asked again, and the shard comes whole from a."""
    manifest = read_manifest(tokens)
    b_data = tmp_path / "b-data"
    shutil.copytree(tokens, b_data)
    rotten = manifest.val[len(manifest.val) // 2].file  # a whole unit (the last may be short: one chunk)
    args = ["--inner-steps", "20", "--state-timeout", "10"]
    cache_of = caches(tmp_path)
    with LocalSwarm(tmp_path, config=TINY, extra_args=args) as swarm:
        swarm.start("a", "--data", str(tokens), *cache_of("a"))
        swarm.start("b", "--data", str(b_data), *cache_of("b"), join="a")
        swarm.wait_for(lambda: swarm.events("a", "inner") and swarm.events("b", "inner"), timeout=60,
                       what="a and b training")
        path = b_data / rotten
        path.write_bytes(bytes(x ^ 0x5A for x in path.read_bytes()))  # same size, every byte wrong
        c_data, cache = copy_manifest(tokens, tmp_path / "c-data"), tmp_path / "c-cache"
        swarm.start("c", "--data", str(c_data), "--shard-cache", str(cache), join="a")
        swarm.wait_for(lambda: swarm.events("c", "inner"), timeout=90, what="c training")
        a, b = peer_id(swarm, "a"), peer_id(swarm, "b")
        held_out = [f for f in fetches(swarm, "c") if f["shard"] in {s.file for s in manifest.val}]
        assert len(held_out) == len(manifest.val) and not fetches(swarm, "c", ok=False), swarm.events("c", "fetch")
        # before the rotten one, both holders served chunks of every held-out shard; after it, a alone
        at = [f["shard"] for f in held_out].index(rotten)
        assert all(set(f["bytes"]) == {a, b} for f in held_out[:at]), held_out
        assert all(set(f["bytes"]) == {a} for f in held_out[at + 1:]), held_out
        caught = [f for f in held_out if f.get("corrupt")]
        assert [(f["shard"], f["corrupt"]) for f in caught] == [(rotten, [b])]
        assert rotten in check_cache(cache, manifest)
        assert swarm.stderr("c", tail=1 << 20).count(f"peer {b} served bytes") == 1
        # b is not asked again: c's train shards came from a alone
        swarm.wait_for(lambda: len(fetches(swarm, "c")) > len(manifest.val), timeout=60, what="a train shard fetched")
        assert all(set(f["bytes"]) == {a} for f in fetches(swarm, "c")[len(manifest.val):])
        assert "Traceback" not in swarm.stderr("c", tail=1 << 20)
