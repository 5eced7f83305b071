"""Chaos: real `p2pdiloco join` processes on 127.0.0.1, killed and frozen for real by the test.

A "crash" is SIGKILL to the peer's whole process group (trainer, DHT and averager processes,
p2pd), the way a machine dies. Every scenario is bounded in time and LocalSwarm reaps all.

Timing of the tiny preset used here: inner_steps 30 (~1.5 s of compute), matchmaking_time 2 s,
allreduce_timeout 10 s, verdict_timeout 4 s.
"""

from __future__ import annotations

import math
import random
import signal
import time

import pytest

from p2pdiloco.checkpoint import NAME, checkpoint_paths
from p2pdiloco.localswarm import LocalSwarm
from tests.conftest import TINY, evaluated

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

FLAGS = ["--inner-steps", "30", "--state-timeout", "5"]
# a survivor's next applied round after a crash: its round in flight may wait for a verdict that
# never comes (verdict_timeout 4 s) or an all-reduce that never ends (allreduce_timeout 10 s),
# then a new matchmaking window (2 s) and inner_steps of compute (~2-5 s on 2 busy cores)
RECOVERY_BOUND_S = 2 + 10 + 4 + 10


def max_outer(swarm, name):
    return max([r["outer_step"] for r in swarm.events(name, "outer")], default=0)


def applied_after(swarm, name, t):
    return [r for r in swarm.events(name, "outer") if r["time"] > t]


def checkpoint_steps(ckpt_dir):
    """Outer steps of the complete checkpoints in a directory, newest first (a file is renamed into
    place once written and fsynced; a write in progress is a .tmp)."""
    return [int(NAME.match(p.name).group(1)) for p in checkpoint_paths(ckpt_dir)]


def eval_by_step(swarm, names, after=0.0):
    by_step = {}
    for name in names:
        for r in evaluated(swarm.events(name, "outer")):
            if r["time"] > after:
                by_step.setdefault(r["outer_step"], []).append(r["eval_loss"])
    return by_step


def assert_anchors_agree(swarm, names, after):
    """Peers that applied the same outer step evaluate the same anchor. The members of one round
    log it a moment apart: a caller that just saw one member apply waits for another's record."""
    swarm.wait_for(lambda: any(len(v) >= 2 for v in eval_by_step(swarm, names, after).values()), timeout=30,
                   what="an outer step applied by two survivors")
    shared = {k: v for k, v in eval_by_step(swarm, names, after).items() if len(v) >= 2}
    for step, losses in shared.items():
        assert max(losses) - min(losses) < 0.02, (step, losses)


@pytest.fixture
def swarm(tmp_path, corpus):
    with LocalSwarm(tmp_path, config=TINY, extra_args=["--data", str(corpus), *FLAGS]) as s:
        yield s


def start_three(swarm, *extra):
    swarm.start("a", *extra("a") if callable(extra) else ())
    swarm.start("b", join="a")
    swarm.start("c", join="a")
    swarm.wait_for(lambda: all(len(swarm.events(n, "outer")) >= 2 for n in "abc"), timeout=150,
                   what="two outer steps on every peer")


def test_sigkill_random_peer_then_the_first_peer(swarm):
    """Scenarios 1 and 2: a random peer dies mid inner loop, then the first peer (the one everyone
    bootstrapped from) dies too; a new peer joins through a survivor. There is no central node."""
    swarm.start("a")
    for name in "bcd":
        swarm.start(name, join="a")
    swarm.wait_for(lambda: all(len(swarm.events(n, "outer")) >= 2 for n in "abcd"), timeout=150,
                   what="two outer steps on every peer")
    victim = random.Random(0).choice("bcd")
    survivors = [n for n in "abcd" if n != victim]
    swarm.signal(victim, signal.SIGKILL)
    t_kill = time.time()
    swarm.wait_for(lambda: all(applied_after(swarm, n, t_kill) for n in survivors), timeout=90,
                   what="an applied round on every survivor")
    for n in survivors:
        first = applied_after(swarm, n, t_kill)[0]
        assert first["time"] - t_kill < RECOVERY_BOUND_S, (n, first["time"] - t_kill)

    swarm.signal("a", signal.SIGKILL)
    t_kill = time.time()
    survivors = [n for n in survivors if n != "a"]
    swarm.wait_for(lambda: all(len(applied_after(swarm, n, t_kill)) >= 2 for n in survivors), timeout=90,
                   what="the others continue without the first peer")
    assert_anchors_agree(swarm, survivors, after=t_kill)
    swarm.start("e", join=survivors[-1])  # nobody needs the first peer's address any more
    swarm.wait_for(lambda: swarm.events("e", "join") and swarm.events("e", "outer"), timeout=120,
                   what="e joined through a survivor and applied a round")
    assert swarm.events("e", "join")[0]["loaded_outer_step"] >= 1


def test_sigkill_mid_allreduce_never_applies_partial(swarm):
    start_three(swarm)
    seen = len(swarm.events("c", "allreduce_started"))
    deadline = time.monotonic() + 60
    while len(swarm.events("c", "allreduce_started")) == seen and time.monotonic() < deadline:
        time.sleep(0.02)
    assert time.monotonic() < deadline, "c never started another all-reduce"
    swarm.signal("c", signal.SIGKILL)
    t_kill = time.time()
    swarm.wait_for(lambda: all(len(applied_after(swarm, n, t_kill)) >= 3 for n in "ab"), timeout=120,
                   what="survivors keep averaging")
    # the round c died in was either discarded by both survivors or completed for everyone;
    # either way the survivors' anchors agree afterwards
    assert_anchors_agree(swarm, "ab", after=t_kill)
    for n in "ab":
        assert all(math.isfinite(r["eval_loss"]) for r in evaluated(swarm.events(n, "outer")))
        # a groupmate's death is an expected event: one warning line, not hivemind's tracebacks
        assert "Traceback" not in swarm.stderr(n, tail=1 << 30), swarm.stderr(n, tail=3000)


@pytest.mark.timeout(420)  # up to 5 tries of the freeze (below)
def test_sigstop_longer_than_allreduce_timeout_then_catch_up_by_merge(swarm):
    start_three(swarm)
    c_id = swarm.events("c", "outer")[-1]["peer"][-6:]

    def lost_since(n: str, t: float) -> list:
        return [r for r in swarm.events(n, "round_failed") if r["time"] > t and c_id in r["lost"]]

    # the survivors see c vanish from the round (its parts, its verdict or its check terms never come; or the
    # other survivor's verdict names it) and stop counting it at once (its record lives 15 s). The SIGSTOP must
    # land in the middle of a round: a round of this model lasts about a second and the test reads the logs
    # every 0.25 s, so it can land once the round is over (CI saw it: nobody then saw c vanish from a round,
    # and the survivors waited for c's record to expire). Then c is woken and its next round tried, 5 at most:
    # in CI at 846f870 all 3 tries missed: one landed after c's round was over, and in two a survivor did not
    # name c (a round whose reducer dropped c after c had sent all its parts, and one that ran into
    # allreduce_timeout, report no lost member: docs/chaos.md, "Who a failed round names")
    for attempt in range(5):
        entered = len(swarm.events("c", "allreduce_started"))
        swarm.wait_for(lambda: len(swarm.events("c", "allreduce_started")) > entered, timeout=60,
                       what="c's next round")
        swarm.signal("c", signal.SIGSTOP)  # in the middle of a round: its parts or its verdict never come
        t_stop = time.time()
        before = {n: max_outer(swarm, n) for n in "ab"}
        try:  # allreduce_timeout (10 s) and the verdict's 4 s bound how long a survivor waits for c
            swarm.wait_for(lambda: all(lost_since(n, t_stop) for n in "ab"), timeout=20,
                           what="both survivors name c lost")
            break
        except TimeoutError:
            if attempt == 4:
                raise
            swarm.signal("c", signal.SIGCONT)
    try:
        # nobody hangs on the frozen peer: the others keep applying rounds while it is stopped
        swarm.wait_for(lambda: all(max_outer(swarm, n) >= before[n] + 3 for n in "ab"), timeout=90,
                       what="a and b progress while c is frozen")
        time.sleep(max(0.0, t_stop + 12 - time.time()))  # frozen longer than allreduce_timeout (10 s)
    finally:
        swarm.signal("c", signal.SIGCONT)
    t_cont = time.time()
    # their rounds while c is frozen are whole groups of 2, not groups that wait out the window for c
    lost = {n: [r for r in lost_since(n, t_stop) if r["time"] < t_cont] for n in "ab"}
    assert all(lost.values()), {n: swarm.events(n, "round_failed")[-3:] for n in "ab"}
    for n in "ab":
        frozen = [r for r in swarm.events(n, "outer") if lost[n][0]["time"] < r["time"] < t_cont]
        assert frozen and all(r["swarm_size"] == 2 for r in frozen), frozen
    # the round c froze in may still complete when it wakes, if every part had reached it (outer step
    # at most before["a"] + 1); c's first round formed after waking is on top of the swarm's state, not
    # its stale anchor: its anchor differs, so the round merges and c takes a's and b's (newer) anchor,
    # with no download
    def rejoined():
        return [r for r in applied_after(swarm, "c", t_cont) if r["outer_step"] > before["a"] + 1]

    swarm.wait_for(rejoined, timeout=90, what="c contributes again")
    first = rejoined()[0]
    assert first["merged"] and first["outer_step"] > before["a"] + 3, first
    assert not [r for r in swarm.events("c", "resync") if r["time"] > t_cont], "no state download"
    assert_anchors_agree(swarm, "abc", after=t_cont)
    for n in "abc":  # rounds that a frozen member broke, and its own when it wakes: no tracebacks
        assert "Traceback" not in swarm.stderr(n, tail=1 << 30), swarm.stderr(n, tail=3000)


def test_restart_with_identity_and_checkpoint_rejoins(tmp_path, swarm):
    ident = lambda n: ["--identity-path", str(tmp_path / f"{n}.key"),  # noqa: E731
                       "--checkpoint-dir", str(tmp_path / f"{n}.ckpt"), "--checkpoint-every", "1"]
    swarm.start("a", *ident("a"))
    swarm.start("b", *ident("b"), join="a")
    swarm.start("c", *ident("c"), join="a")
    swarm.wait_for(lambda: all(len(swarm.events(n, "outer")) >= 2 for n in "abc"), timeout=150,
                   what="two outer steps on every peer")
    peer_id = swarm.events("c", "outer")[0]["peer"]
    swarm.signal("c", signal.SIGKILL)
    swarm.wait_exit("c", timeout=10)
    t_kill = time.time()
    swarm.wait_for(lambda: max_outer(swarm, "a") >= max_outer(swarm, "c") + 2, timeout=90,
                   what="the swarm moves ahead of c's checkpoint")
    swarm.start("c", *ident("c"), join="b")
    swarm.wait_for(lambda: applied_after(swarm, "c", t_kill), timeout=120, what="c contributes again")
    back = [r for r in swarm.events("c") if r["time"] > t_kill]
    assert back[0]["peer"] == peer_id, "same identity, same peer id"
    assert any(r["event"] == "resume" for r in back), "restarted from its checkpoint"
    assert any(r["event"] == "join" and r["loaded_outer_step"] > max_outer(swarm, "c") - 10 for r in back)


def test_kill_all_and_restart_from_checkpoints(tmp_path, swarm):
    ckpt = lambda n: ["--identity-path", str(tmp_path / f"{n}.key"),  # noqa: E731
                      "--checkpoint-dir", str(tmp_path / f"{n}.ckpt"), "--checkpoint-every", "1"]
    saved_steps = lambda n: checkpoint_steps(tmp_path / f"{n}.ckpt")
    swarm.start("a", *ckpt("a"))
    swarm.start("b", *ckpt("b"), join="a")
    swarm.wait_for(lambda: all(len(swarm.events(n, "outer")) >= 3 for n in "ab"), timeout=150,
                   what="three outer steps on both peers")
    # a step's `outer` record is logged before its checkpoint is written (outer.py, Rounds._land_round): wait for
    # the checkpoint of each peer's latest record, the one it is to resume from (a ckpt-*.pt is renamed into
    # place once complete), not for the record (CI saw a SIGKILL between the two: a resume one step behind)
    swarm.wait_for(lambda: all(len(saved_steps(n)) >= 2 and saved_steps(n)[0] >= max_outer(swarm, n) for n in "ab"),
                   timeout=30, what="the checkpoint of the latest outer step on both peers")
    waited = {n: saved_steps(n)[0] for n in "ab"}
    for n in "ab":
        swarm.signal(n, signal.SIGKILL)
    for n in "ab":
        swarm.wait_exit(n, timeout=10)
    t_kill = time.time()
    # a peer may have applied one more round between that wait and the kill, and been killed before or
    # after its checkpoint: it resumes from its newest checkpoint on disk, never one older than waited for
    saved = {n: saved_steps(n) for n in "ab"}
    assert all(len(saved[n]) >= 2 and saved[n][0] >= waited[n] for n in "ab"), (saved, waited)
    last = {n: steps[0] for n, steps in saved.items()}
    assert all(max_outer(swarm, n) - last[n] in (0, 1) for n in "ab"), (saved, last)
    # b's newest checkpoint is torn (a crash mid-copy, a bad disk): it must fall back to the previous one
    newest_b = checkpoint_paths(tmp_path / "b.ckpt")[0]
    newest_b.write_bytes(newest_b.read_bytes()[:1000])

    swarm.start("a", *ckpt("a"))
    swarm.start("b", *ckpt("b"), join="a")
    swarm.wait_for(lambda: all(applied_after(swarm, n, t_kill) for n in "ab"), timeout=120,
                   what="training resumes on both peers")
    resume_a = [r for r in swarm.events("a", "resume") if r["time"] > t_kill][0]
    resume_b = [r for r in swarm.events("b", "resume") if r["time"] > t_kill][0]
    assert resume_a["outer_step"] == last["a"], (resume_a, last)
    assert resume_b["outer_step"] == saved["b"][1], "the torn newest checkpoint was skipped"
    # b's whole stderr: status lines and warnings since the restart can push that line out of a short tail
    assert "checksum mismatch" in swarm.stderr("b", tail=1 << 30)
    first_a = applied_after(swarm, "a", t_kill)[0]
    assert first_a["outer_step"] == max(last["a"], saved["b"][1]) + 1, "the outer step continues where it stopped"
    # the schedule and the model continue too: the anchor's loss is where it was, not at random init
    swarm.wait_for(lambda: evaluated(applied_after(swarm, "a", t_kill)), timeout=30, what="an evaluated outer step")
    assert evaluated(applied_after(swarm, "a", t_kill))[0]["eval_loss"] < math.log(256) - 1.0


def test_faulty_peers_are_excluded_and_model_stays_finite(swarm):
    """x sends NaN pseudo-gradients, y ones a million times too large; a and b are unmodified."""
    swarm.start("a")
    swarm.start("b", join="a")
    for name, how in (("x", "nan"), ("y", "huge")):
        swarm.env["P2PDILOCO_TEST_CORRUPT"] = how  # only this peer corrupts its outgoing pseudo-gradient
        try:
            swarm.start(name, join="a")
        finally:
            del swarm.env["P2PDILOCO_TEST_CORRUPT"]
    swarm.wait_for(lambda: all(swarm.events(n, "bad_contribution") for n in "xy"), timeout=120,
                   what="x and y in a group")
    t0 = time.time()
    swarm.wait_for(lambda: all(len(applied_after(swarm, n, t0)) >= 3 for n in "ab"), timeout=120,
                   what="a and b keep applying rounds")
    faulty = {swarm.events(n, "inner")[0]["peer"]: n for n in "xy"}
    for n in "ab":
        bad = swarm.events(n, "bad_contribution")
        assert {faulty.get(r["sender"]) for r in bad} >= {"x", "y"}, bad
        # an honest peer may be judged bad now and then, never for what x and y did: clipped far from
        # the others (a merge round's stale anchor), or excluded in a pair with a much smaller norm (of
        # two members the smaller one is trusted; a's rounds that x and y spoiled left its pseudo-gradient
        # growing: "norm 17 > 10x the group median 0.111", CI); it is never banned for it
        honest = [r for r in bad if r["sender"] not in faulty]
        assert all(r["reason"].startswith("clipped") or "x the group median" in r["reason"] for r in honest), honest
        assert len(honest) <= 2, honest
        assert not {r["sender"] for r in swarm.events(n, "banned")} - set(faulty), swarm.events(n, "banned")
        assert any("nan" in r["reason"] for r in bad) and any("excluded" in r["reason"] for r in bad), bad
        outer = evaluated(swarm.events(n, "outer"))
        assert outer and all(math.isfinite(r["eval_loss"]) for r in outer)
        assert outer[-1]["eval_loss"] < math.log(256) - 1.0
    assert_anchors_agree(swarm, "ab", after=t0)
    # the faulty peers never apply an average their own values spoiled
    for n in "xy":
        assert all(math.isfinite(r["eval_loss"]) for r in evaluated(swarm.events(n, "outer")))
        # discarded as its own contribution rejected, or, in a pair (CI: every group y met), as the group's
        # only usable contribution being someone else's
        assert any("our own contribution was rejected" in r["reason"] or "usable contribution(s)" in r["reason"]
                   for r in swarm.events(n, "round_failed")), swarm.events(n, "round_failed")


def test_poisoned_anchor_in_merge_rounds_is_excluded(swarm):
    """z offers merge rounds a NaN anchor (and a digest that differs, so every round with it
    merges): a and b exclude it, like a poisoned pseudo-gradient, and keep a finite, learning model."""
    swarm.start("a")
    swarm.start("b", join="a")
    swarm.env["P2PDILOCO_TEST_CORRUPT"] = "anchor_nan"
    try:
        swarm.start("z", join="a")
    finally:
        del swarm.env["P2PDILOCO_TEST_CORRUPT"]
    anchor_rejected = lambda n: [r for r in swarm.events(n, "bad_contribution") if "anchor" in r["reason"]]  # noqa: E731
    swarm.wait_for(lambda: all(anchor_rejected(n) for n in "ab"), timeout=120,
                   what="z's anchor rejected in a merge round with a and b")
    t0 = time.time()
    swarm.wait_for(lambda: all(len(applied_after(swarm, n, t0)) >= 3 for n in "ab"), timeout=120,
                   what="a and b keep applying rounds")
    poisoned = swarm.events("z", "inner")[0]["peer"]
    for n in "ab":
        bad = swarm.events(n, "bad_contribution")
        assert poisoned in {r["sender"] for r in bad}, bad
        assert {r["sender"] for r in anchor_rejected(n)} == {poisoned}
        # as in test_faulty_peers_are_excluded_and_model_stays_finite: an honest peer far from the other may
        # be clipped now and then (CI: b clipped a to 0.39 in a round of the two of them, a having trained
        # alone first), never for an anchor, and never banned
        honest = [r for r in bad if r["sender"] != poisoned]
        assert all(r["reason"].startswith("clipped") for r in honest) and len(honest) <= 2, honest
        assert not {r["sender"] for r in swarm.events(n, "banned")} - {poisoned}, swarm.events(n, "banned")
        outer = evaluated(swarm.events(n, "outer"))
        assert outer and all(math.isfinite(r["eval_loss"]) for r in outer)
        assert outer[-1]["eval_loss"] < math.log(256) - 1.0
    assert_anchors_agree(swarm, "ab", after=t0)
    # z never applies a round that its own anchor took part in; whatever it applies is finite
    assert all(math.isfinite(r["eval_loss"]) for r in evaluated(swarm.events("z", "outer")))
    assert any("our own contribution was rejected" in r["reason"] for r in swarm.events("z", "round_failed"))
