"""Exact DiLoCo math against hand-written references (CPU torch only, no network)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from p2pdiloco import diloco, state
from p2pdiloco.averaging import contribution_weight
from p2pdiloco.config import Config
from p2pdiloco.model import GPT, flat_params, load_flat_

OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- pseudo-gradient ---------------------------------------------------------------------------


def test_pseudo_grad_is_anchor_minus_snapshot():
    anchor = torch.tensor([1.0, -2.0, 3.5, 0.0])
    snapshot = torch.tensor([0.5, -1.0, 4.0, 2.0])
    g = diloco.pseudo_grad(anchor, snapshot)
    assert_close(g, torch.tensor([0.5, -1.0, -0.5, -2.0]))
    # inputs are not modified
    assert_close(anchor, torch.tensor([1.0, -2.0, 3.5, 0.0]))
    assert_close(snapshot, torch.tensor([0.5, -1.0, 4.0, 2.0]))


def test_pseudo_grad_random():
    a = torch.randn(1000, generator=_gen(1))
    s = torch.randn(1000, generator=_gen(2))
    assert_close(diloco.pseudo_grad(a, s), a - s, rtol=0, atol=0)


# --- outer Nesterov step -----------------------------------------------------------------------


@pytest.mark.parametrize("outer_lr,outer_momentum", [(0.7, 0.9), (0.5, 0.0), (1.0, 0.5)])
def test_outer_step_matches_torch_sgd_nesterov(outer_lr, outer_momentum):
    n, steps = 257, 5
    anchor0 = torch.randn(n, generator=_gen(10))
    grads = [torch.randn(n, generator=_gen(100 + i)) for i in range(steps)]

    # reference: torch's SGD with Nesterov momentum, pseudo-gradient used as .grad
    param = torch.nn.Parameter(anchor0.clone())
    # (torch refuses nesterov=True without momentum; plain SGD is the same update then)
    opt = torch.optim.SGD([param], lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)

    anchor = anchor0.clone()
    momentum = torch.zeros(n)
    for g in grads:
        param.grad = g.clone()
        opt.step()
        diloco.outer_step_(anchor, momentum, g, outer_lr=outer_lr, outer_momentum=outer_momentum)
        assert_close(anchor, param.detach())
        if outer_momentum > 0:
            assert_close(momentum, opt.state[param]["momentum_buffer"])
    # the anchor actually moved
    assert not torch.allclose(anchor, anchor0)


def test_outer_step_one_step_by_hand():
    anchor = torch.tensor([1.0, 2.0])
    momentum = torch.tensor([0.5, -1.0])
    g = torch.tensor([0.2, 0.4])
    diloco.outer_step_(anchor, momentum, g, outer_lr=0.5, outer_momentum=0.9)
    # momentum = 0.9 * [0.5, -1.0] + [0.2, 0.4] = [0.65, -0.5]
    assert_close(momentum, torch.tensor([0.65, -0.5]))
    # anchor = [1, 2] - 0.5 * ([0.2, 0.4] + 0.9 * [0.65, -0.5])
    #        = [1, 2] - 0.5 * [0.785, -0.05] = [0.6075, 2.025]
    assert_close(anchor, torch.tensor([0.6075, 2.025]))
    # the pseudo-gradient is not modified in place
    assert_close(g, torch.tensor([0.2, 0.4]))


def test_outer_step_once_per_group_not_per_arrival():
    n = 64
    anchor0 = torch.randn(n, generator=_gen(3))
    momentum0 = torch.randn(n, generator=_gen(4))
    grads = [torch.randn(n, generator=_gen(20 + i)) for i in range(3)]
    weights = [contribution_weight(t, a) for t, a in ((100, 0), (300, 3), (50, 1))]
    total = sum(weights)
    mean = sum(w * g for w, g in zip(weights, grads)) / total

    # once per group, with the weighted mean
    a_group, m_group = anchor0.clone(), momentum0.clone()
    diloco.outer_step_(a_group, m_group, mean, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM)

    # by hand
    m_hand = OUTER_MOMENTUM * momentum0 + mean
    a_hand = anchor0 - OUTER_LR * (mean + OUTER_MOMENTUM * m_hand)
    assert_close(m_group, m_hand)
    assert_close(a_group, a_hand)

    # the weighted mean by hand, element-wise for one coordinate
    i = 7
    mean_i = sum(w * float(g[i]) for w, g in zip(weights, grads)) / total
    assert mean[i].item() == pytest.approx(mean_i, rel=1e-5)

    # once per arrival, each arrival carrying its weighted share (same sum of pseudo-gradients):
    # with momentum this is NOT the same update
    a_arr, m_arr = anchor0.clone(), momentum0.clone()
    for w, g in zip(weights, grads):
        diloco.outer_step_(a_arr, m_arr, g * (w / total), outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM)
    assert (a_arr - a_group).abs().max() > 1e-2
    assert (m_arr - m_group).abs().max() > 1e-2

    # without momentum the step is linear and both ways agree (so the difference above is the momentum)
    a_g0, m_g0 = anchor0.clone(), torch.zeros(n)
    diloco.outer_step_(a_g0, m_g0, mean, outer_lr=OUTER_LR, outer_momentum=0.0)
    a_a0, m_a0 = anchor0.clone(), torch.zeros(n)
    for w, g in zip(weights, grads):
        diloco.outer_step_(a_a0, m_a0, g * (w / total), outer_lr=OUTER_LR, outer_momentum=0.0)
    assert_close(a_a0, a_g0)


# --- merge ---------------------------------------------------------------------------------------


def test_merge_local_keeps_progress():
    new_anchor = torch.tensor([1.0, 2.0, 3.0])
    local = torch.tensor([0.5, 0.5, 0.5])
    snapshot = torch.tensor([0.25, 1.0, 0.5])
    assert_close(diloco.merge_local(new_anchor, local, snapshot), torch.tensor([1.25, 1.5, 3.0]))


def test_merge_local_without_progress_is_new_anchor():
    new_anchor = torch.randn(100, generator=_gen(5))
    local = torch.randn(100, generator=_gen(6))
    out = diloco.merge_local(new_anchor, local, local.clone())
    assert_close(out, new_anchor, rtol=0, atol=0)
    # a fresh tensor, not an alias of the anchor
    assert out.data_ptr() != new_anchor.data_ptr()


# --- inner lr schedule -----------------------------------------------------------------------


SCHED = dict(inner_lr=1e-3, warmup_steps=10, total_steps=100, min_lr_ratio=0.1)


def _lr(position: int, **kw) -> float:
    return diloco.inner_lr_at(position, **{**SCHED, **kw})


def test_inner_lr_warmup_is_linear():
    assert _lr(0) == pytest.approx(1e-3 / 10)
    assert _lr(9) == pytest.approx(1e-3)
    for p in range(10):
        assert _lr(p) == pytest.approx(1e-3 * (p + 1) / 10)


def test_inner_lr_peak_and_cosine():
    peak = max(_lr(p) for p in range(0, 300))
    assert peak == pytest.approx(1e-3)
    assert _lr(10) == pytest.approx(1e-3)                                   # warmup end
    assert _lr(55) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))               # half way: cos = 0
    p = 30
    want = 1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (p - 10) / 90)))
    assert _lr(p) == pytest.approx(want)
    assert _lr(100) == pytest.approx(1e-4)
    assert _lr(101) == pytest.approx(1e-4)
    assert _lr(10_000) == pytest.approx(1e-4)


def test_inner_lr_monotone_after_warmup():
    lrs = [_lr(p) for p in range(9, 250)]
    assert all(b <= a + 1e-15 for a, b in zip(lrs, lrs[1:]))
    assert lrs[0] > lrs[-1]


def test_inner_lr_without_warmup_starts_at_peak():
    assert _lr(0, warmup_steps=0) == pytest.approx(1e-3)
    assert _lr(100, warmup_steps=0) == pytest.approx(1e-4)


# --- contribution weight -------------------------------------------------------------------------


def test_contribution_weight():
    assert contribution_weight(1000, 0) == pytest.approx(1000.0)
    assert contribution_weight(1000, 3) == pytest.approx(500.0)
    assert contribution_weight(800, 8) == pytest.approx(800 / 3)
    assert contribution_weight(1000, -5) == pytest.approx(1000.0)
    assert contribution_weight(0, 0) > 0
    assert contribution_weight(0, 0) >= 1.0
    assert contribution_weight(0, 3) > 0
    # staler is lighter, more tokens is heavier
    assert contribution_weight(1000, 1) < contribution_weight(1000, 0)
    assert contribution_weight(2000, 1) > contribution_weight(1000, 1)


# --- anchor digest -----------------------------------------------------------------------------


def test_digest_indices_deterministic():
    a = diloco.digest_indices(10_000)
    b = diloco.digest_indices(10_000)
    assert torch.equal(a, b)
    assert a.numel() == diloco.DIGEST_SIZE
    assert int(a.min()) >= 0 and int(a.max()) < 10_000
    small = diloco.digest_indices(100)
    assert small.numel() == 100 and int(small.max()) < 100
    assert not torch.equal(diloco.digest_indices(10_001)[:50], a[:50])


def test_digest_spread():
    numel = 10_000
    idx = diloco.digest_indices(numel)
    anchor = torch.randn(numel, generator=_gen(7))
    d = diloco.anchor_digest(anchor, idx)
    assert isinstance(d, list) and len(d) == idx.numel()
    assert d == anchor[idx].tolist()
    assert diloco.digest_spread(d, diloco.anchor_digest(anchor.clone(), idx)) == 0.0

    perturbed = anchor * (1 + 1e-2)
    dp = diloco.anchor_digest(perturbed, idx)
    assert diloco.digest_spread(dp, d) == pytest.approx(1e-2, rel=1e-3)
    assert diloco.digest_spread(d, dp) == pytest.approx(1e-2, rel=2e-2)

    far = diloco.anchor_digest(anchor + 1.0, idx)
    assert diloco.digest_spread(far, d) > 0.5

    assert diloco.digest_spread(d, d[:-1]) == math.inf
    assert diloco.digest_spread(d[:10], d) == math.inf


# --- flat parameters ---------------------------------------------------------------------------


def _tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT.from_config(Config(n_layer=1, n_head=2, n_embd=16, block_size=8))


def test_flat_params_round_trip():
    model = _tiny_gpt()
    flat = flat_params(model)
    n = sum(p.numel() for p in model.parameters())
    assert flat.shape == (n,) and flat.dtype == torch.float32
    new = torch.randn(n, generator=_gen(8))
    load_flat_(model, new)
    assert_close(flat_params(model), new, rtol=0, atol=0)
    # flat_params is a copy, not a view
    got = flat_params(model)
    got.zero_()
    assert_close(flat_params(model), new, rtol=0, atol=0)
    # parameters in order: the first one is the token embedding
    assert_close(model.wte.weight.detach().reshape(-1), new[: model.wte.weight.numel()], rtol=0, atol=0)
    # and back
    load_flat_(model, flat)
    assert_close(flat_params(model), flat, rtol=0, atol=0)


def test_load_flat_too_long_raises_value_error():
    model = _tiny_gpt()
    n = flat_params(model).numel()
    with pytest.raises(ValueError):
        load_flat_(model, torch.zeros(n + 1))


def test_load_flat_too_short_raises_value_error_and_keeps_weights():
    model = _tiny_gpt()
    before = flat_params(model)
    with pytest.raises(ValueError):
        load_flat_(model, torch.zeros(before.numel() - 1))
    torch.testing.assert_close(flat_params(model), before)


# --- outer state validation ------------------------------------------------------------------


NUMEL = 50


def _good(cfg: Config, outer_step: int = 3):
    metadata = state.make_metadata(cfg, outer_step)
    tensors = [torch.randn(NUMEL, generator=_gen(9)), torch.randn(NUMEL, generator=_gen(10))]
    return metadata, tensors


def test_validate_state_accepts_good_state():
    cfg = Config()
    metadata, tensors = _good(cfg)
    st = state.validate_state(metadata, tensors, cfg, NUMEL)
    assert st.outer_step == 3
    assert_close(st.anchor, tensors[0], rtol=0, atol=0)
    assert_close(st.momentum, tensors[1], rtol=0, atol=0)
    # views of the downloaded tensors (the averager's staging buffer), not copies: the peer copies
    # them into its live state, and a 685 MB state is not held twice
    assert st.anchor.data_ptr() == tensors[0].data_ptr()


def test_validate_state_accepts_other_shapes_and_dtypes():
    cfg = Config()
    metadata, (a, m) = _good(cfg, 0)
    st = state.validate_state(metadata, [a.view(5, 10).half(), m.view(10, 5)], cfg, NUMEL)
    assert st.anchor.shape == (NUMEL,) and st.anchor.dtype == torch.float32
    assert st.outer_step == 0


def _rejects(metadata, tensors, cfg, numel=NUMEL):
    with pytest.raises(ValueError):
        state.validate_state(metadata, tensors, cfg, numel)


def test_validate_state_rejects_other_fingerprint():
    cfg = Config()
    metadata, tensors = _good(Config(n_embd=128))
    _rejects(metadata, tensors, cfg)


def test_validate_state_rejects_other_run_id():
    cfg = Config()
    metadata, tensors = _good(Config(run_id="other-run"))
    _rejects(metadata, tensors, cfg)
    # the run_id is checked by itself too, not only through the fingerprint
    metadata, tensors = _good(cfg)
    metadata["run_id"] = "other-run"
    _rejects(metadata, tensors, cfg)


def test_validate_state_rejects_bad_metadata():
    cfg = Config()
    _, tensors = _good(cfg)
    _rejects(None, tensors, cfg)
    _rejects([], tensors, cfg)
    _rejects({}, tensors, cfg)


def test_validate_state_rejects_wrong_tensor_count():
    cfg = Config()
    metadata, tensors = _good(cfg)
    _rejects(metadata, tensors[:1], cfg)
    _rejects(metadata, tensors + [tensors[0].clone()], cfg)


def test_validate_state_rejects_wrong_numel():
    cfg = Config()
    metadata, tensors = _good(cfg)
    _rejects(metadata, tensors, cfg, NUMEL + 1)
    _rejects(metadata, [tensors[0], tensors[1][:-1]], cfg)


@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_validate_state_rejects_non_finite(which, bad):
    cfg = Config()
    metadata, tensors = _good(cfg)
    tensors[which][17] = bad
    _rejects(metadata, tensors, cfg)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_all_finite_finds_a_bad_value_in_any_chunk(bad):
    """state.all_finite reads 2**18 values at a time (no full-size temporaries): it must agree
    with torch.isfinite(t).all() wherever the bad value sits, the last, short chunk included."""
    t = torch.randn(2 * (1 << 18) + 6)  # three chunks, the last of 6 values
    assert state.all_finite(t) and state.all_finite(t.view(-1, 2)) and state.all_finite(torch.empty(0))
    for where in (0, (1 << 18) - 1, 1 << 18, t.numel() - 1):
        u = t.clone()
        u[where] = bad
        assert not state.all_finite(u) and not state.all_finite(u.view(-1, 2)), where
    assert state.all_finite(torch.full((10,), 3e38)) and not state.all_finite(torch.full((10,), 3e38) * 10)


@pytest.mark.parametrize("outer_step", [-1, 3.0, "3", None])
def test_validate_state_rejects_bad_outer_step(outer_step):
    cfg = Config()
    metadata, tensors = _good(cfg)
    metadata["outer_step"] = outer_step
    _rejects(metadata, tensors, cfg)


# --- contribution policy (what every reducer excludes) ----------------------------------------


def test_contribution_policy_excludes_non_finite_and_outliers():
    from p2pdiloco.allreduce import ContributionPolicy

    gathered = [{"norm": 3.0, "weight": 100.0}, {"norm": 4.0, "weight": 100.0}, {"norm": float("nan"), "weight": 1.0},
                {"norm": 4e6, "weight": 1e9}, {"norm": 5.0, "weight": 100.0}]
    policy = ContributionPolicy.from_gathered(gathered, max_norm_ratio=10.0)
    assert policy.excluded == [False, False, True, True, False]
    assert policy.valid == 3
    assert set(policy.notes) == {2, 3} and "excluded" in policy.notes[3]
    assert policy.norm_caps[0] == pytest.approx(3.0 * 1.01 + 1e-6) and policy.norm_caps[3] == 0.0
    # weights are capped at max_norm_ratio x the lower median weight (100)
    assert policy.weight_caps == [1000.0] * 5


def test_contribution_policy_two_members_uses_the_lower_median():
    from p2pdiloco.allreduce import ContributionPolicy

    policy = ContributionPolicy.from_gathered([{"norm": 2.0}, {"norm": 50.0}], max_norm_ratio=10.0)
    assert policy.excluded == [False, True]
    policy = ContributionPolicy.from_gathered([{"norm": 2.0}, {"norm": 19.0}], max_norm_ratio=10.0)
    assert policy.excluded == [False, False]
    # a malformed announcement (not a dict, no norm) is excluded, not a crash
    assert ContributionPolicy.from_gathered([None, {"norm": 1.0}], max_norm_ratio=10.0).excluded == [True, False]


def test_group_share_is_members_over_the_lower_median_view():
    assert diloco.group_share([4, 4]) == 0.5
    assert diloco.group_share([4, 4, 4, 4]) == 1.0
    assert diloco.group_share([3, 4]) == pytest.approx(2 / 3)       # lower median of two views
    assert diloco.group_share([1, 1]) == 1.0                        # never more than a full step
    assert diloco.group_share([4, 10**9, 4]) == 0.75                # one liar moves nothing
    assert diloco.group_share([4, float("nan"), "x"]) == 1.0        # bad views count as 1
    assert diloco.group_share([]) == 1.0


# --- eager outer updates -----------------------------------------------------------------------


def test_preview_outer_step_is_the_step_outer_step_would_take():
    anchor, momentum = torch.randn(300, generator=_gen(40)), torch.randn(300, generator=_gen(41))
    g = torch.randn(300, generator=_gen(42))
    preview = diloco.preview_outer_step(anchor, momentum, g, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM)
    a, m = anchor.clone(), momentum.clone()
    diloco.outer_step_(a, m, g, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM)
    assert_close(preview, a)
    # nothing moved: the preview is only where the local model trains while the round runs
    assert_close(anchor, torch.randn(300, generator=_gen(40)))
    assert_close(momentum, torch.randn(300, generator=_gen(41)))


def test_mixed_preview_is_the_step_with_the_mixed_estimate():
    """eager_mix: the preview is the outer step with own_share x our pseudo-gradient + the rest from the
    momentum's running mean; own_share 1 is the plain preview."""
    anchor, momentum = torch.randn(300, generator=_gen(47)), torch.randn(300, generator=_gen(48))
    g = torch.randn(300, generator=_gen(49))
    share = 0.25
    preview = diloco.preview_outer_step(anchor, momentum, g, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM,
                                        own_share=share)
    estimate = share * g + (1 - share) * (1 - OUTER_MOMENTUM) * momentum
    a, m = anchor.clone(), momentum.clone()
    diloco.outer_step_(a, m, estimate, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM)
    assert_close(preview, a)
    plain = diloco.preview_outer_step(anchor, momentum, g, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM)
    assert_close(diloco.preview_outer_step(anchor, momentum, g, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM,
                                           own_share=1.0), plain)
    assert not torch.allclose(preview, plain)


def test_eager_correction_lands_where_a_late_merge_would():
    """Training from the preview and moving the progress onto the real new anchor afterwards leaves
    the same weights as training from the snapshot and merging (the progress is kept either way)."""
    anchor, momentum = torch.randn(50, generator=_gen(43)), torch.zeros(50)
    snapshot = torch.randn(50, generator=_gen(44))
    progress = torch.randn(50, generator=_gen(45)) * 0.01
    g_own, g_avg = anchor - snapshot, torch.randn(50, generator=_gen(46))
    preview = diloco.preview_outer_step(anchor, momentum, g_own, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM)
    new_anchor, m = anchor.clone(), momentum.clone()
    diloco.outer_step_(new_anchor, m, g_avg, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM)
    eager = diloco.merge_local(new_anchor, preview + progress, preview)
    late = diloco.merge_local(new_anchor, snapshot + progress, snapshot)
    assert_close(eager, late)
    # a failed round moves the progress back onto the snapshot: our own work is kept for the next round
    assert_close(diloco.merge_local(snapshot, preview + progress, preview), snapshot + progress)


# --- merge rounds ------------------------------------------------------------------------------


def _member(digest, outer_step, **extra):
    return {"digest": digest, "outer_step": outer_step, **extra}


def test_merge_weights_none_when_anchors_agree():
    d = [1.0, 2.0, 3.0]
    assert diloco.merge_weights([_member(d, 3), _member([1.0, 2.0, 3.0000001], 3)], 1e-3) is None
    assert diloco.merge_weights([_member(d, 3)], 1e-3) is None
    # members without a digest (an older or foreign peer): no merge plan
    assert diloco.merge_weights([_member(d, 3), {"outer_step": 3}], 1e-3) is None


def test_merge_weights_newest_outer_step_only():
    a, b = [1.0, 2.0, 3.0], [1.5, 2.0, 3.0]
    assert diloco.merge_weights([_member(a, 4), _member(b, 4)], 1e-3) == [1.0, 1.0]
    assert diloco.merge_weights([_member(a, 4), _member(b, 2), _member(a, 4)], 1e-3) == [1.0, 0.0, 1.0]
    assert diloco.anchors_differ([a, a, b], 1e-3) and not diloco.anchors_differ([a, a], 1e-3)


def test_merge_scales_turn_one_weight_per_sender_into_merge_weights():
    """hivemind averages sum(w x) / sum(w) with one weight per sender; senders scale their anchors
    so that the result is sum(v anchor) / sum(v) with the merge weights v."""
    from p2pdiloco.allreduce import ContributionPolicy

    n = 40
    anchors = [torch.randn(n, generator=_gen(50 + i)) for i in range(3)]
    weights, votes = [1000.0, 3000.0, 500.0], [1.0, 1.0, 0.0]
    gathered = [{"norm": 1.0, "weight": w, "anchor_norm": float(a.norm()), "momentum_norm": 0.0}
                for w, a in zip(weights, anchors)]
    policy = ContributionPolicy.from_gathered(gathered, max_norm_ratio=10.0, merge=votes)
    assert not policy.merge_problem and policy.valid == 3
    sent = [a * s for a, s in zip(anchors, policy.merge_scales)]
    hivemind_average = sum(w * x for w, x in zip(weights, sent)) / sum(weights)
    assert_close(hivemind_average, (anchors[0] + anchors[1]) / 2)
    # each sender's anchor segment is capped by its own announced norm, scaled as sent
    for i, caps in enumerate(policy.segment_caps):
        assert float(sent[i].norm()) <= caps[1]


def test_merge_policy_excludes_bad_anchor_announcements():
    from p2pdiloco.allreduce import ContributionPolicy

    base = {"norm": 1.0, "weight": 1.0, "momentum_norm": 1.0}
    gathered = [{**base, "anchor_norm": 10.0}, {**base, "anchor_norm": 10.5}, {**base, "anchor_norm": float("nan")},
                {**base, "anchor_norm": 1e6}]
    policy = ContributionPolicy.from_gathered(gathered, max_norm_ratio=10.0, merge=[1.0, 1.0, 1.0, 1.0])
    assert policy.excluded == [False, False, True, True]
    assert "anchor_norm" in policy.notes[2] and "excluded" in policy.notes[3]
    assert policy.merge_scales[2] == policy.merge_scales[3] == 0.0
    # nobody usable at the newest outer step: the round cannot merge and fails
    bad = [{**base, "anchor_norm": float("nan")}, {**base, "anchor_norm": -1.0}, {**base, "anchor_norm": 10.0}]
    policy = ContributionPolicy.from_gathered(bad, max_norm_ratio=10.0, merge=[1.0, 1.0, 0.0])
    assert policy.excluded == [True, True, False] and policy.merge_problem


def test_dynamic_inner_steps_scale_with_speed():
    assert diloco.dynamic_inner_steps(50, 100.0, [100.0, 100.0]) == 50
    assert diloco.dynamic_inner_steps(50, 150.0, [150.0, 50.0]) == 75   # twice the mean... of 100
    assert diloco.dynamic_inner_steps(50, 50.0, [150.0, 50.0]) == 25
    # a 4x straggler next to three fast peers: all due at once, 4 x 50 steps between them
    fast, slow = (diloco.dynamic_inner_steps(50, s, [4.0, 4.0, 4.0, 1.0]) for s in (4.0, 1.0))
    assert (fast, slow) == (62, 15) and abs(3 * fast + slow - 200) <= 2
    # unknown or broken speeds: plain inner_steps; the scale is bounded
    assert diloco.dynamic_inner_steps(50, None, [1.0]) == 50
    assert diloco.dynamic_inner_steps(50, 1.0, [math.nan, -1]) == 50
    assert diloco.dynamic_inner_steps(50, 1000.0, [1000.0] + [10.0] * 7) == 200
    assert diloco.dynamic_inner_steps(50, 1.0, [1000.0] + [1.0] * 7) == 12


def test_matchmaking_lead_is_the_smoothed_mean_wait():
    # a hand-written reference: half the previous lead plus half the mean of the reported waits
    assert diloco.matchmaking_lead(0.0, [0.2, 0.6, 1.0, 0.2], cap_s=5.0) == pytest.approx(0.25)
    assert diloco.matchmaking_lead(0.4, [0.4, 0.4], cap_s=5.0) == pytest.approx(0.4)
    # the same announcements give every member the same lead, whatever its order
    assert diloco.matchmaking_lead(0.1, [1.0, 0.0, 0.5], cap_s=2.0) == diloco.matchmaking_lead(0.1, [0.5, 1.0, 0.0],
                                                                                              cap_s=2.0)
    # converges to the mean wait when it stays the same
    lead = 0.0
    for _ in range(30):
        lead = diloco.matchmaking_lead(lead, [0.3, 0.5], cap_s=5.0)
    assert lead == pytest.approx(0.4, abs=1e-6)


def test_matchmaking_lead_ignores_bad_reports_and_stays_capped():
    # a member's first round (None), garbage and non-finite reports are ignored; the rest clipped
    assert diloco.matchmaking_lead(0.2, [None, "x", math.nan, True], cap_s=1.0) == pytest.approx(0.2)
    assert diloco.matchmaking_lead(0.0, [math.inf, 0.4], cap_s=1.0) == pytest.approx(0.2)
    assert diloco.matchmaking_lead(0.0, [1e9, 1e9], cap_s=1.0) == pytest.approx(0.5)
    assert diloco.matchmaking_lead(0.0, [-5.0, 0.4], cap_s=1.0) == pytest.approx(0.1)
    assert diloco.matchmaking_lead(3.0, [], cap_s=1.0) == 1.0   # a smaller cap (a faster peer) applies at once
    lead = 0.0
    for _ in range(50):
        lead = diloco.matchmaking_lead(lead, [1e9], cap_s=0.75)
    assert lead == pytest.approx(0.75)


@pytest.mark.parametrize("full_groups,formed_at_step,expected", [
    (True, 112, 18),    # the round formed at our step 112, then failed: count from the formation
    (True, None, 30),   # it never formed (nobody else ready): the count from our own start stands
    (False, 112, 30),   # full_groups off: every member counts from its own start, as before
])
def test_a_failed_round_counts_the_next_inner_steps_as_an_applied_one(full_groups, formed_at_step, expected):
    """The members of a group that formed and then failed must stay in phase, as after an applied
    round: each counts from the same formation, not from its own entry into matchmaking."""
    import concurrent.futures

    from p2pdiloco.averaging import RoundOutcome
    from p2pdiloco.boundary import Boundary
    from p2pdiloco.metrics import Metrics
    from p2pdiloco.outer import OuterState, PendingRound, Rounds
    from p2pdiloco.state import SharedState
    from p2pdiloco.suspects import Suspects

    outer = OuterState(SharedState(4, shared=False))
    outer.step = 3
    # the round driver without the peer's network parts: no network is touched here
    loop = Rounds(Config(full_groups=full_groups), outer=outer, model=None, numel=4,
                  boundary=Boundary([torch.zeros(4)], numel=4), metrics=Metrics(None, "a"),
                  suspects=Suspects(ban_time=0.0))
    loop.inner_step, loop.steps_since_round = 130, 30   # we entered matchmaking at step 100
    future = concurrent.futures.Future()
    future.set_result(RoundOutcome(ok=False, reason="incomplete round: 5888 of 120576 values never came back"))
    pending = PendingRound(future, torch.zeros(4), False, 0, 1.0, 0, start_step=100, formed_at_step=formed_at_step)
    assert loop._finish_round(pending) is False
    assert loop.steps_since_round == expected and loop.rounds_failed == 1


def test_a_banned_peer_or_one_that_left_is_not_part_of_our_swarm():
    """A peer that stopped cleanly said so in its last record; a peer we banned cannot join our groups:
    counting it would make every group wait out the window for it and never count as whole, and its
    record must not set the outer step we resync to (an attacker's claim) or our phase. The ban takes
    effect in the group size at once, not at the next read."""
    import time

    from p2pdiloco.boundary import Boundary
    from p2pdiloco.metrics import Metrics
    from p2pdiloco.outer import OuterState, Rounds
    from p2pdiloco.schedule import Clock
    from p2pdiloco.state import SharedState
    from p2pdiloco.suspects import Suspects

    suspects = Suspects(ban_time=600.0, peer_id="a")
    loop = Rounds(Config(), outer=OuterState(SharedState(4, shared=False)), model=None, numel=4,
                  boundary=Boundary([torch.zeros(4)], numel=4), metrics=Metrics(None, "a"), suspects=suspects,
                  peer_id="a")
    loop.clock = Clock(inner_steps=50, now=time.time(), inner_step=0)
    now = time.time()
    # "0x" (the attacker) sorts first: on a tie of two phases, its phase would win
    honest = {p: {"outer_step": 7, "due": now + 5.0, "period": 10.0} for p in ("a", "b")}
    records = {**honest, "0x": {"outer_step": 40, "due": now + 1.0, "period": 10.0}}
    loop._note_progress(records)
    assert loop.swarm_size == 3 and loop.swarm_outer_step == 40
    suspects.banned_until["0x"] = time.monotonic() + 600.0
    loop._count_swarm()  # what landing the round that banned it does
    assert loop.swarm_size == 2
    loop.clock.in_phase = False  # out of phase (a partial group): the next read takes the swarm's
    loop._note_progress({**records, "0y": {"outer_step": 7, "due": now + 1.0, "period": 10.0},
                         "0z": {"outer_step": 9, "due": now + 1.0, "period": 10.0, "left": True}})
    assert loop.swarm_size == 3 and loop.swarm_outer_step == 7  # 0z stopped cleanly: not counted either
    assert abs(loop.clock.due - (now + 5.0)) < 1e-6  # the honest peers' phase, not the banned peer's and y's


def test_a_member_that_vanished_from_our_round_counts_again_only_once_it_publishes():
    """A member whose parts or verdict never came (killed mid-round) is left out of the group size at once:
    its record lives on until it expires, and every group would wait out the matchmaking window for it.
    A straggler, or a peer cut off for a moment, publishes a newer record and counts again; an older copy
    of a record (DHT reads can return one) does not bring a dead peer back."""
    from p2pdiloco.averaging import RoundOutcome
    from p2pdiloco.boundary import Boundary
    from p2pdiloco.metrics import Metrics
    from p2pdiloco.outer import OuterState, PendingRound, Rounds
    from p2pdiloco.state import SharedState
    from p2pdiloco.suspects import Suspects

    loop = Rounds(Config(), outer=OuterState(SharedState(4, shared=False)), model=None, numel=4,
                  boundary=Boundary([torch.zeros(4)], numel=4), metrics=Metrics(None, "a"),
                  suspects=Suspects(ban_time=600.0, peer_id="a"), peer_id="a")
    records = {p: {"outer_step": 7, "time": 100.0} for p in "abcd"}
    loop._note_progress(records)
    assert loop.swarm_size == 4
    pending = PendingRound(None, torch.zeros(4), eager=False, tokens=0, weight=1.0, age=0)
    loop._land_round(pending, RoundOutcome(ok=False, reason="incomplete round", lost=["a", "c", "d"]))
    assert loop.swarm_size == 2 and set(loop.gone) == {"c", "d"}  # at once; we never count ourselves out
    loop._note_progress(records)  # the records as they were: c's and d's last ones
    loop._note_progress({**records, "d": {"outer_step": 7, "time": 98.0}})  # an older replica of d's record
    assert loop.swarm_size == 2
    loop._note_progress({**records, "c": {"outer_step": 7, "time": 102.0}})  # c published since: alive
    assert loop.swarm_size == 3 and set(loop.gone) == {"d"}
    loop._note_progress({p: r for p, r in records.items() if p != "d"})  # d's record expired
    assert loop.swarm_size == 3 and not loop.gone


@pytest.mark.parametrize("eager", [True, False])
def test_a_round_in_flight_keeps_only_its_pseudo_gradient(eager):
    """The snapshot and the eager base are recomputed from the pseudo-gradient, the anchor and the
    momentum (unchanged while a round is in flight): the local weights land where merge_local (the
    reference) puts them, after an applied round and after a failed one."""
    from p2pdiloco.boundary import Boundary
    from p2pdiloco.metrics import Metrics
    from p2pdiloco.model import flat_params, load_flat_
    from p2pdiloco.outer import OuterState, PendingRound, Rounds
    from p2pdiloco.state import SharedState
    from p2pdiloco.suspects import Suspects

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))
    numel = sum(p.numel() for p in model.parameters())
    outer = OuterState(SharedState(numel, shared=False))
    loop = Rounds(Config(), outer=outer, model=model, boundary=Boundary(list(model.parameters()), numel=numel),
                  numel=numel, metrics=Metrics(None, "a"), suspects=Suspects(ban_time=0.0))
    outer.anchor, outer.momentum = torch.randn(numel), torch.randn(numel) * 0.1
    snapshot = torch.randn(numel)
    delta = outer.anchor - snapshot
    base = diloco.preview_outer_step(outer.anchor, outer.momentum, delta, outer_lr=loop.cfg.outer_lr,
                                     outer_momentum=loop.cfg.outer_momentum) if eager else snapshot
    local = base + torch.randn(numel) * 0.01  # the steps made while the round ran
    for applied in (True, False):
        load_flat_(loop.model, local)
        pending = PendingRound(None, delta.clone(), eager, 0, 1.0, 0)
        if applied:
            loop.kept = loop._local_progress(pending, out=pending.delta)
            new_anchor = outer.anchor + 0.5
            outer.anchor = new_anchor
            loop._place_progress()
            assert_close(flat_params(model), diloco.merge_local(new_anchor, local, base), rtol=0, atol=1e-6)
            outer.anchor = new_anchor - 0.5
        else:
            loop._undo_preview(pending)
            assert_close(flat_params(loop.model), diloco.merge_local(snapshot, local, base), rtol=0, atol=1e-6)


def test_outer_step_scale_is_a_scaled_pseudo_gradient():
    torch.manual_seed(1)
    anchor, momentum, g = torch.randn(100), torch.randn(100), torch.randn(100)
    a1, m1, a2, m2 = anchor.clone(), momentum.clone(), anchor.clone(), momentum.clone()
    diloco.outer_step_(a1, m1, g * 0.4, outer_lr=0.7, outer_momentum=0.9)
    diloco.outer_step_(a2, m2, g, scale=0.4, outer_lr=0.7, outer_momentum=0.9)
    assert_close(a1, a2, rtol=0, atol=1e-6)
    assert_close(m1, m2, rtol=0, atol=1e-6)


def test_a_state_header_with_a_malformed_digest_is_not_a_source():
    from p2pdiloco.state import _valid_digest

    assert _valid_digest([0.5, -1.0, 0.0], 3)
    for bad in ([0.5, float("nan"), 0.0], [0.5, 1.0], [1, 2, 3], "abc", None, [0.5, "x", 0.0]):
        assert not _valid_digest(bad, 3), bad


def test_the_kept_model_averages_the_anchors_of_outer_steps_and_restarts_on_a_new_anchor():
    """The model a peer keeps: at its n-th outer step average += max(w, 1/n) (anchor - average), the mean of
    the anchors its outer steps made until there are 1/w of them, then an exponential moving average. A state
    taken from elsewhere (the start, a download) is not an outer step of ours: the average is that anchor until
    our next step, which replaces it (a random init or a far older download must not weigh in the mean)."""
    from p2pdiloco.outer import OuterState
    from p2pdiloco.state import SharedState

    outer = OuterState(SharedState(3, shared=False), average_weight=0.25)
    outer.load(torch.full((3,), 100.0), torch.zeros(3), 0)  # the init
    assert_close(outer.kept(), torch.full((3,), 100.0))
    kept = []
    for i, value in enumerate((4.0, 8.0, -2.0, 10.0, 2.0)):
        with outer.updating(stepped=True):
            outer.anchor.fill_(value)
            outer.step = i + 1
        kept.append(float(outer.kept()[0]))
    # the mean of 4, 8, -2, 10 (n = 1..4, 1/n >= w), then w = 0.25 on the fifth: 5 + 0.25 (2 - 5)
    assert kept == pytest.approx([4.0, 6.0, 10 / 3, 5.0, 4.25])
    assert_close(outer.anchor, torch.full((3,), 2.0))  # the anchor itself is untouched: the swarm trains on from it
    outer.load(torch.full((3,), 7.0), torch.zeros(3), 50)  # a download from the swarm: far from our history
    assert_close(outer.kept(), torch.full((3,), 7.0))
    with outer.updating(stepped=True):
        outer.anchor.fill_(9.0)
    assert_close(outer.kept(), torch.full((3,), 9.0))
    plain = OuterState(SharedState(3, shared=False))  # anchor_average 0: no copy, the anchor is the kept model
    assert plain.average is None and plain.kept() is plain.anchor
    with pytest.raises(ValueError, match="anchor_average"):
        Config(anchor_average=1.5)
