"""Tables and plots of scripts/bench.py's results.json: `results.md` (one headline row per target,
one column per seed, then every comparison in detail) and PNG plots of eval loss against tokens
and wall time."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

from p2pdiloco.plot import pyplot


def _opened(lines: list, comp, title: str) -> bool:
    """Start a section; a comparison that could not run here says why and shows no table."""
    if not comp:
        return False
    lines += [title, ""]
    if "skipped" in comp:
        lines += [f"skipped: {comp['skipped']}", ""]
        return False
    return True


def headline(results: dict) -> list[str]:
    """One row per target, one column per seed: the numbers docs/benchmarks.md quotes."""
    seeds = list(results["by_seed"])
    rows: dict[str, list[str]] = {}

    def put(key: str, seed_index: int, text: str) -> None:
        rows.setdefault(key, ["-"] * len(seeds))[seed_index] = text

    for i, seed in enumerate(seeds):
        comps = {k: v for k, v in results["by_seed"][seed].items() if "error" not in v and "skipped" not in v}
        if "quality" in comps:
            q = comps["quality"]
            for name in ("ddp", "sync_h50", "decoupled_h50", "sync_h100", "decoupled_h100"):
                if name in q["runs"]:  # the quick size has no pair at 2H
                    put(f"final eval loss, {name}", i, f"{q['runs'][name]['final_eval']:.4f}")
            for g in q["gaps_pct"]:
                put(f"{g['what']} (target <= +{g['target_pct']}%)", i,
                    f"{g['pct']:+.2f}% {'met' if g['met'] else 'MISSED'}")
            c = q["negative_control"]
            put(f"negative control: {c['what']}", i, f"{c['pct']:+.2f}% {'seen' if c['seen'] else 'NOT SEEN'}")
        if "traffic" in comps:
            for r in comps["traffic"]["ratios"]:
                target = f" (target >= {r['target']}x)" if r["target"] else ""
                met = "" if r["met"] is None else (" met" if r["met"] else " MISSED")
                put(f"wire bytes sent, fp32 DDP / p2pdiloco {r['codec']}{target}", i,
                    f"{r['ratio_vs_fp32_ddp']:.0f}x{met}")
        if "stragglers" in comps:
            s = comps["stragglers"]
            for name, r in s["runs"].items():
                put(f"{name}: swarm tok/s / sum of own speeds", i, f"{r['throughput_vs_own_speeds']:.3f}")
                put(f"{name}: time to eval loss {s['target_loss']:.3f} (s)", i, _num(r["time_to_target_s"]))
        if "slowlinks" in comps:
            sl = comps["slowlinks"]
            put("slow links: p2pdiloco compute utilization (target >= 0.97)", i,
                f"{sl['utilization']:.3f} {'met' if sl['met'] else 'MISSED'}")
            put("slow links: wall time DDP / p2pdiloco at equal tokens", i, f"{sl['speedup_vs_ddp']:.2f}x")
        if "overhead" in comps:
            for H, o in comps["overhead"]["by_inner_steps"].items():
                put(f"overhead of join vs bare loop, H={H} (target <= 3%)", i,
                    f"{o['overhead_pct']:+.2f}% {'met' if o['met'] else 'MISSED'}")
        for comp in ("byzantine", "byzantine_collude"):
            for c in comps.get(comp, {}).get("checks", []):
                put(f"{c['what']} (target {c['target']})", i, f"{_num(c['value'])} {_met(c['met'])}")
    lines = ["| measure | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---" * (len(seeds) + 1) + "|"]
    lines += [f"| {k} | " + " | ".join(v) + " |" for k, v in rows.items()]
    return lines


def across_seeds(results: dict, comp: str) -> list[str]:
    """Mean and range over seeds of every run of a comparison (ablation, quality): final eval loss,
    the gap to its baseline, and the swarm's behaviour."""
    per_run: dict[str, list] = {}
    gaps: dict[str, list] = {}
    for comps in results["by_seed"].values():
        c = comps.get(comp)
        if not c or "runs" not in c:
            continue
        for name, r in c["runs"].items():
            per_run.setdefault(name, []).append(r)
        for g in c.get("gaps_pct", []):
            gaps.setdefault(g["what"].split(" vs ")[0], []).append((g["what"].split(" vs ")[1], g["pct"]))
    if not per_run:
        return []
    seeds = max(len(v) for v in per_run.values())
    lines = [f"### {comp}: mean over {seeds} seed(s) [min, max]", "",
             "| run | final eval loss | gap | outer steps/peer | rounds with every live peer | merges | resyncs "
             "| max eval jump % | anchors agree | steps per contribution, median / p90 | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, runs in per_run.items():
        evals = [r["final_eval"] for r in runs]
        gap = gaps.get(name)
        gap_text = (f"{statistics.mean(p for _, p in gap):+.2f}% vs {gap[0][0]} "
                    f"[{min(p for _, p in gap):+.2f}, {max(p for _, p in gap):+.2f}]") if gap else ""
        swarm = [r for r in runs if r.get("kind") == "p2pdiloco"]

        def avg(key, fmt):
            values = [r[key] for r in swarm if r.get(key) is not None]
            return format(statistics.mean(values), fmt) if values else "-"

        outer = [statistics.mean(p["outer_steps_applied"] for p in r["peers"].values()) for r in swarm]
        agree = [r["anchor_spread"]["agree"] for r in swarm if r.get("anchor_spread", {}).get("agree") is not None]
        steps = [r["contribution_steps"] for r in swarm if (r.get("contribution_steps") or {}).get("median")]
        steps_text = (f"{statistics.mean(c['median'] for c in steps):.0f} / "
                      f"{statistics.mean(c['p90'] for c in steps):.0f}") if steps else "-"
        lines.append(f"| {name} | {statistics.mean(evals):.4f} [{min(evals):.4f}, {max(evals):.4f}] | {gap_text} | "
                     f"{format(statistics.mean(outer), '.1f') if outer else '-'} | "
                     f"{avg('full_group_fraction', '.2f')} | "
                     f"{avg('merges', '.1f')} | {avg('resyncs', '.1f')} | {avg('max_eval_jump_pct', '+.1f')} | "
                     f"{format(statistics.mean(agree), '.2f') if agree else '-'} | {steps_text} | "
                     f"{avg('ratio', '.1f')} |")
    return lines + [""]


def report(results: dict, out: Path) -> str:
    lines = ["# p2pdiloco benchmarks", "", *headline(results), ""]
    for comp in ("ablation", "quality"):
        lines += across_seeds(results, comp)
    for seed, comps in results["by_seed"].items():
        lines += [f"## seed {seed}", ""]
        for name, comp in list(comps.items()):
            if "error" in comp:
                lines += [f"### {name}: FAILED", "", f"    {comp['error'][:500]}", ""]
        comps = {name: comp for name, comp in comps.items() if "error" not in comp}
        q = comps.get("quality")
        if q:
            lines += ["### quality (final eval loss, same token budget)", "",
                      "| run | final eval loss | tokens | wall s | outer steps/peer | resyncs |", "|---|---|---|---|---|---|"]
            for r in q["runs"].values():
                peers = r.get("peers", {})
                outer = statistics.mean(p["outer_steps_applied"] for p in peers.values()) if peers else "-"
                resyncs = sum(p["resyncs"] for p in peers.values()) if peers else "-"
                lines.append(f"| {r['name']} | {r['final_eval']:.4f} | {r['tokens']} | {r['wall_s']:.0f} | "
                             f"{_num(outer)} | {resyncs} |")
            lines += ["", "| comparison | gap | target | |", "|---|---|---|---|"]
            for g in q["gaps_pct"]:
                lines.append(f"| {g['what']} | {g['pct']:+.2f}% | <= +{g['target_pct']}% | "
                             f"{'met' if g['met'] else 'MISSED'} |")
            c = q["negative_control"]
            lines += [f"| negative control: {c['what']} | {c['pct']:+.2f}% | worse (> +1%) | "
                      f"{'seen' if c['seen'] else 'NOT SEEN'} |", ""]
        sw = comps.get("sweep")
        if sw:
            lines += ["### sweep (final eval loss over outer_lr x outer_momentum)", "", "| run | final eval loss |",
                      "|---|---|"]
            lines += [f"| {r['name']} | {r['final_eval']:.4f} |" for r in sw["runs"].values()]
            lines += ["", "best: " + ", ".join(f"{mode} {name}" for mode, name in sw["best"].items()), ""]
        t = comps.get("traffic")
        if _opened(lines, t, "### traffic (bytes at each host's interface, per peer per inner step)"):
            lines += ["| run | sent B/step | recv B/step | DDP fp32 / this | target | |", "|---|---|---|---|---|---|"]
            lines.append(f"| ddp fp32 | {t['runs']['ddp']['wire_sent_per_step']:.0f} | "
                         f"{t['runs']['ddp']['wire_recv_per_step']:.0f} | 1 | | |")
            for r in t["ratios"]:
                run = t["runs"][r["codec"]]
                target = f">= {r['target']}x" if r["target"] else ""
                met = "" if r["met"] is None else ("met" if r["met"] else "MISSED")
                lines.append(f"| p2pdiloco {r['codec']} | {run['wire_sent_per_step']:.0f} | "
                             f"{run['wire_recv_per_step']:.0f} | {r['ratio_vs_fp32_ddp']:.0f}x | {target} | {met} |")
            lines.append("")
        s = comps.get("stragglers")
        if s:
            lines += [f"### stragglers (one peer 4x slower; target loss {s['target_loss']:.4f})", "",
                      "| mode | swarm tok/s | sum of own speeds | ratio | time to target s | final eval |",
                      "|---|---|---|---|---|---|"]
            for r in s["runs"].values():
                lines.append(f"| {r['name']} | {r['swarm_tokens_per_s']:.0f} | {r['sum_own_tokens_per_s']:.0f} | "
                             f"{r['throughput_vs_own_speeds']:.3f} | {_num(r['time_to_target_s'])} | "
                             f"{r['final_eval']:.4f} |")
            lines += ["", f"decoupled throughput >= 95% of own speeds: {'met' if s['met'] else 'MISSED'}", ""]
        sl = comps.get("slowlinks")
        if _opened(lines, sl, "### slow links"):
            lines += [f"{sl['rate_mbit']:g} Mbit/s per host (tc tbf, both directions)", "",
                      "| run | wall s | tokens | compute utilization |", "|---|---|---|---|"]
            for r in sl["runs"].values():
                lines.append(f"| {r['name']} | {r['wall_s']:.1f} | {r['tokens']} | "
                             f"{_num(r.get('compute_utilization'))} |")
            lines += ["", f"p2pdiloco utilization {sl['utilization']:.3f} (target >= 0.97: "
                      f"{'met' if sl['met'] else 'MISSED'}); wall time DDP / p2pdiloco {sl['speedup_vs_ddp']:.2f}x", ""]
        if comps.get("overhead"):
            lines += ["### overhead", "", "| H | rounds/peer | step in join ms | bare loop ms | overhead | |",
                      "|---|---|---|---|---|---|"]
            for H, o in comps["overhead"]["by_inner_steps"].items():
                lines.append(f"| {H} | {o['rounds_per_peer']:.0f} | {o['peer_step_ms']:.2f} | {o['bare_step_ms']:.2f} | "
                             f"{o['overhead_pct']:+.2f}% | {'met' if o['met'] else 'MISSED'} (<= 3%) |")
            lines.append("")
        hm = comps.get("hivemind")
        if hm:
            lines += ["### hivemind.Optimizer (use_local_updates, parameters averaged every ~H steps per peer)", "",
                      "| run | final eval loss | tokens | wall s | rounds |", "|---|---|---|---|---|"]
            for r in hm["runs"].values():
                if r["kind"] == "hivemind":
                    rounds = f"epochs {r['epochs']}, averaged {r['rounds_averaged']}, failed {r['rounds_failed']}"
                else:
                    rounds = f"{statistics.mean(p['outer_steps_applied'] for p in r['peers'].values()):.1f}/peer"
                    if "rounds_to_full_after_kill" in r:  # None: no round after the kill held every survivor
                        back = ", ".join(f"{k} {v if v is not None else 'never'}"
                                         for k, v in r["rounds_to_full_after_kill"].items())
                        rounds += f"; rounds after the kill until one held every survivor: {back}"
                lines.append(f"| {r['name']} | {_num(r['final_eval'])} | {r['tokens']} | {r['wall_s']:.0f} | "
                             f"{rounds} |")
            lines += ["", "| comparison | p2pdiloco | hivemind | gap | |", "|---|---|---|---|---|"]
            for c in hm["pairs"]:
                gap = "-" if c["pct"] is None else f"{c['pct']:+.2f}%"
                lines.append(f"| {c['what']} | {_num(c['p2pdiloco'])} | {_num(c['hivemind'])} | {gap} | "
                             f"{'ahead' if c['ahead'] else 'NOT AHEAD'} |")
            lines.append("")
        for comp in ("byzantine", "byzantine_collude"):
            if comps.get(comp):
                lines += byzantine_tables(comp, comps[comp])
        g = comps.get("gpu")
        if _opened(lines, g, "### gpu (2 small-gpu peers)"):
            mfu = ", ".join(f"{m:.1%}" for m in g["mfu"]) if g["mfu"] else "unknown peak"
            lines += [f"{g['device']}: inner tokens/s per peer "
                      f"{', '.join(f'{t:.0f}' for t in g['inner_tokens_per_s'])}; MFU {mfu}; inner step "
                      f"{g['peer_step_ms']:.1f} ms vs bare loop {g['bare_step_ms']:.1f} ms "
                      f"({g['overhead_pct']:+.2f}%)", ""]
            for peer, split in g.get("time_split", {}).items():
                rest = 1 - split["compute"] - split["data"] - split["outer"]
                lines.append(f"- {peer}: of the wall time, inner steps {split['compute']:.1%}, data "
                             f"{split['data']:.1%}, starting and applying rounds {split['outer']:.1%} (evaluations "
                             f"{split['eval']:.1%}), the rest {rest:.1%}")
            lines.append("")
    text = "\n".join(lines)
    (out / "results.md").write_text(text)
    return text


def byzantine_tables(comp: str, b: dict) -> list[str]:
    """bench.py byzantine: every (attack, rule) run over the honest peers, then its targets."""
    attackers = max(r["colluders"] for r in b["runs"].values())
    lines = [f"### {comp} ({attackers} attacker(s) of {b['peers']} peers; settled eval of the honest peers (at "
             "their last round with a majority of the swarm) over the clean swarm's under the mean)", "",
             "| run | attack | rule | final eval loss: anchor / kept model | kept over the last whole group's "
             "anchor, % | / control's kept "
             "| settled eval loss | / clean mean | round s | clipped: attacker / honest | banned: attacker / honest "
             "| reducer checks of its groups that flagged the attacker |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in b["runs"].values():
        if "error" in r:
            lines.append(f"| {r['name']} | {r['attack']} | {r['rule']} | FAILED: {r['error'][:200]} | | | | | | | | |")
            continue
        d = r["defence"]
        check = d["reducer_check"]
        caught = f"{check['caught']}/{check['rounds']}" if check["rounds"] else "-"
        lines.append(f"| {r['name']} | {r['attack']} | {r['rule']} | {r['final_eval']:.4f} / "
                     f"{r.get('kept_eval', math.nan):.4f} | "
                     f"{_num(r.get('end_of_run_pct'))} | {_num(r.get('final_vs_control'))} | "
                     f"{r.get('settled_eval', math.nan):.4f} | {_num(r['ratio'])} | "
                     f"{_num(r['round_s'])} | {d['clipped_attacker']} / {d['clipped_honest']} | "
                     f"{d['banned_attacker']} / {d['banned_honest']} | {caught} |")
    lines += ["", "| check | value | target | |", "|---|---|---|---|"]
    lines += [f"| {c['what']} | {_num(c['value'])} | {c['target']} | {_met(c['met'])} |" for c in b["checks"]]
    return lines + [""]


def _met(met) -> str:
    return "-" if met is None else ("met" if met else "MISSED")


def _num(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else ("-" if v is None else str(v))


def plot(results: dict, out: Path) -> list[str]:
    try:
        plt = pyplot()
    except ImportError:
        print("bench: matplotlib is not installed (pip install -e '.[bench]'): no plots", file=sys.stderr)
        return []
    made = []
    for seed, comps in results["by_seed"].items():
        for comp in ("quality", "ablation", "stragglers", "slowlinks", "hetero", "hivemind", "byzantine"):
            runs = (comps.get(comp) or {}).get("runs")
            if not runs:
                continue
            if comp == "ablation":  # every variant on one chart is unreadable: the baselines, first and last version
                runs = {k: r for k, r in runs.items() if k == "ddp" or k.split("_h")[0] in ("sync", "none", "all")}
            if comp == "byzantine":  # each rule, clean and under the strongest sign flip
                runs = {k: r for k, r in runs.items() if r["attack"] in ("clean", "signflip:5") and "error" not in r}
            fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
            shown = []
            for r in runs.values():
                curve = [c for c in r["curve"] if c[2] is not None]
                if not curve:
                    continue
                # a diverged run (the negative control) would flatten the others: listed, off the chart
                label = r["name"] if r["final_eval"] < 2 * r["curve"][0][2] else f"{r['name']} (diverged, off chart)"
                if "off chart" not in label:
                    shown += [c[2] for c in curve]
                axes[0].plot([c[0] for c in curve], [c[2] for c in curve], ".-", ms=3, lw=1, label=label)
                axes[1].plot([c[1] for c in curve], [c[2] for c in curve], ".-", ms=3, lw=1, label=label)
            axes[0].set_xlabel("tokens (whole swarm)")
            axes[1].set_xlabel("wall time (s)")
            for ax in axes:
                ax.set_ylabel("eval loss")
                if shown:
                    ax.set_ylim(min(shown) * 0.97, max(shown) * 1.03)
                ax.grid(alpha=0.3)
            axes[1].legend(fontsize=8)
            fig.suptitle(f"{comp}, seed {seed}")
            fig.tight_layout()
            path = out / f"{comp}-seed{seed}.png"
            fig.savefig(path, dpi=90)
            plt.close(fig)
            made.append(path.name)
    return made
