"""`p2pdiloco plot`: one PNG of the metrics of one or more peers (their `--log-dir` directories).

    p2pdiloco plot runs/a runs/b runs/c -o swarm.png --title "tiny, 3 peers"

Panels: loss against the peer's tokens and against wall time (the inner loss of its training
batches as a line, the anchor's eval loss at each outer step as dots), tokens/s, the outer step
against wall time (rounds discarded marked), the group size of each outer step, and the bytes sent
and received in each round. One colour per peer, named by its directory. Wall time counts from
the first record of all the directories (their clocks are the machines' clocks).

matplotlib (the `plot` extra) is imported only when a plot is drawn; `pyplot()` is shared with
scripts/bench_report.py.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import sys
from pathlib import Path
from typing import Optional

from p2pdiloco.metrics import read_metrics

EXIT_USAGE = 2


class PlotError(Exception):
    """Bad input or output for the plot; the CLI prints it on one line and exits 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("log_dirs", nargs="+", metavar="LOG_DIR", help="A peer's --log-dir (holding metrics.jsonl).")
    parser.add_argument("-o", "--output", default="metrics.png", help="PNG to write (default metrics.png).")
    parser.add_argument("--title", default="", help="Figure title (default: the run_id from config.json).")


def run(args: argparse.Namespace) -> int:
    try:
        peers = load(args.log_dirs)
        try:
            plt = pyplot()
        except ImportError:
            raise PlotError("plot needs matplotlib: pip install 'p2pdiloco[plot]'") from None
        draw(plt, peers, Path(args.output), title=args.title or default_title(args.log_dirs))
    except PlotError as e:
        print(f"p2pdiloco: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"p2pdiloco: wrote {args.output} ({len(peers)} peer{'s' * (len(peers) != 1)}, "
          f"{sum(len(records) for _, records in peers)} records)")
    return 0


def pyplot():
    """matplotlib.pyplot drawing to files (backend Agg: no display needed); ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ------------------------------------------------------------------------------------ input

def load(log_dirs: list[str]) -> list[tuple[str, list[dict]]]:
    """(label, records) per directory; a directory with no records yet is left out with a note."""
    labels = [Path(d).resolve().name or str(d) for d in log_dirs]
    if len(set(labels)) < len(labels):  # runs1/a and runs2/a: the paths tell them apart
        labels = [str(d) for d in log_dirs]
    peers, empty = [], []
    for log_dir, label in zip(log_dirs, labels):
        path = Path(log_dir) / "metrics.jsonl"
        if not path.is_file():
            raise PlotError(f"{log_dir} has no metrics.jsonl (pass the --log-dir of a peer)")
        try:
            records = [r for r in read_metrics(path) if isinstance(r, dict) and "event" in r and "time" in r]
        except (OSError, UnicodeDecodeError) as e:
            raise PlotError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
        if records:
            peers.append((label, records))
        else:
            empty.append(path)
    if not peers:
        raise PlotError("no records to plot in " + ", ".join(map(str, log_dirs)))
    for path in empty:
        print(f"p2pdiloco: {path} holds no records yet; left out", file=sys.stderr)
    return peers


def default_title(log_dirs: list[str]) -> str:
    run_ids = set()
    for d in log_dirs:
        try:
            run_ids.add(json.loads((Path(d) / "config.json").read_text()).get("run_id"))
        except (OSError, ValueError, AttributeError):
            run_ids.add(None)
    run_id = run_ids.pop() if len(run_ids) == 1 else None
    return f"p2pdiloco run {run_id!r}" if run_id else "p2pdiloco metrics"


def _num(value) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def curves(records: list[dict], t0: float) -> dict[str, dict[str, list[float]]]:
    """The series one peer's records give, time in seconds since t0. A restarted peer (a new peer
    id appending to the same file) starts a new line segment: a NaN row separates the two."""
    out = {name: {} for name in ("inner", "outer", "steps", "failed", "resync")}

    def add(name: str, **values: float) -> None:
        for key, value in values.items():
            out[name].setdefault(key, []).append(value)

    last_peer = None
    for r in records:
        event, t = r["event"], _num(r["time"]) - t0
        if r.get("peer") != last_peer and last_peer is not None:
            add("inner", t=math.nan, tokens=math.nan, loss=math.nan, tokens_per_s=math.nan)
            add("steps", t=math.nan, outer_step=math.nan)
        last_peer = r.get("peer")
        if event == "inner":
            add("inner", t=t, tokens=_num(r.get("tokens")), loss=_num(r.get("loss")),
                tokens_per_s=_num(r.get("tokens_per_s")))
            add("steps", t=t, outer_step=_num(r.get("outer_step")))
        elif event == "outer":
            add("outer", t=t, outer_step=_num(r.get("outer_step")), eval_loss=_num(r.get("eval_loss")),
                group_size=_num(r.get("group_size")), bytes_sent=_num(r.get("bytes_sent")),
                bytes_recv=_num(r.get("bytes_recv")))
            add("steps", t=t, outer_step=_num(r.get("outer_step")))
        elif event in ("join", "resync", "resume"):  # the outer step this peer jumped to
            add("steps", t=t, outer_step=_num(r.get("loaded_outer_step", r.get("outer_step"))))
            if event == "resync":
                add("resync", t=t, outer_step=_num(r.get("loaded_outer_step")))
        elif event == "round_failed":
            add("failed", t=t, outer_step=_num(r.get("outer_step")))
    # the peer's total tokens when each eval happened, from its inner records around that time
    inner = sorted((t, n) for t, n in zip(out["inner"].get("t", []), out["inner"].get("tokens", []))
                   if math.isfinite(t) and math.isfinite(n))
    out["outer"]["tokens"] = [_interp(t, inner) for t in out["outer"].get("t", [])]
    return out


def _interp(t: float, points: list[tuple[float, float]]) -> float:
    """Linear interpolation in (x, y) points sorted by x, clamped at the ends; NaN without points."""
    if not points:
        return math.nan
    i = bisect.bisect_left(points, (t, -math.inf))
    if i == 0:
        return points[0][1]
    if i == len(points):
        return points[-1][1]
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (t - x0) / (x1 - x0) if x1 > x0 else y1


# ------------------------------------------------------------------------------------- draw

def draw(plt, peers: list[tuple[str, list[dict]]], out: Path, *, title: str) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.ticker import EngFormatter, FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    times = [_num(r["time"]) for _, records in peers for r in records]
    t0 = min(times)
    data = [(label, curves(records, t0)) for label, records in peers]
    t_scale, t_label = (60.0, "wall time (min)") if max(times) - t0 > 900 else (1.0, "wall time (s)")
    biggest = max((b for _, d in data for key in ("bytes_sent", "bytes_recv") for b in d["outer"].get(key, [])
                   if math.isfinite(b)), default=0.0)
    b_scale, b_unit = (1e6, "MB") if biggest >= 1e6 else (1e3, "KB")

    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    (ax_tok, ax_time, ax_tps), (ax_step, ax_group, ax_bytes) = axes
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    n = len(data)
    for i, (label, d) in enumerate(data):
        color = colors[i % len(colors)]
        inner, outer = d["inner"], d["outer"]
        it = [t / t_scale for t in inner.get("t", [])]
        ot = [t / t_scale for t in outer.get("t", [])]
        ax_tok.plot(inner.get("tokens", []), inner.get("loss", []), "-", color=color, lw=1.2, alpha=0.8)
        ax_tok.plot(outer.get("tokens", []), outer.get("eval_loss", []), "o", color=color, ms=4)
        ax_time.plot(it, inner.get("loss", []), "-", color=color, lw=1.2, alpha=0.8)
        ax_time.plot(ot, outer.get("eval_loss", []), "o", color=color, ms=4)
        ax_tps.plot(it, inner.get("tokens_per_s", []), "-", color=color, lw=1.2)
        steps = d["steps"]
        ax_step.step([t / t_scale for t in steps.get("t", [])], steps.get("outer_step", []), where="post",
                     color=color, lw=1.5)
        for name, marker in (("failed", dict(marker="x", mew=1.5)), ("resync", dict(marker="^", mfc="none"))):
            ax_step.plot([t / t_scale for t in d[name].get("t", [])], d[name].get("outer_step", []), ls="",
                         color=color, ms=6, **marker)
        offset = (i - (n - 1) / 2) * min(0.6 / n, 0.2)  # members of a round share x and y: side by side
        ax_group.plot([s + offset for s in outer.get("outer_step", [])], outer.get("group_size", []), "o",
                      color=color, ms=5)
        ax_bytes.plot([s + offset for s in outer.get("outer_step", [])],
                      [b / b_scale for b in outer.get("bytes_sent", [])], "o", color=color, ms=4)
        ax_bytes.plot([s + offset for s in outer.get("outer_step", [])],
                      [b / b_scale for b in outer.get("bytes_recv", [])], "s", color=color, ms=7, mfc="none")

    key = dict(color="0.3")
    _setup(ax_tok, "loss against tokens", "tokens (this peer)", "loss (log scale)",
           [Line2D([], [], ls="-", **key), Line2D([], [], ls="", marker="o", ms=4, **key)],
           ["inner loss (train batches)", "eval loss (anchor, held-out)"])
    _setup(ax_time, "loss against time", t_label, "loss (log scale)")
    _setup(ax_tps, "training speed", t_label, "tokens/s")
    _setup(ax_step, "outer step", t_label, "outer step",
           [Line2D([], [], ls="-", **key), Line2D([], [], ls="", marker="x", mew=1.5, **key),
            Line2D([], [], ls="", marker="^", mfc="none", **key)],
           ["outer step (applied or loaded)", "round discarded", "state reloaded (resync)"])
    _setup(ax_group, "group size of each outer step", "outer step", "peers in the group")
    _setup(ax_bytes, "all-reduce traffic per round", "outer step", b_unit,
           [Line2D([], [], ls="", marker="o", ms=4, **key), Line2D([], [], ls="", marker="s", ms=7, mfc="none", **key)],
           ["sent", "received"])
    for axis in (ax_group.xaxis, ax_bytes.xaxis, ax_step.yaxis, ax_group.yaxis):
        axis.set_major_locator(MaxNLocator(integer=True))
    for axis in (ax_tok.xaxis, ax_tps.yaxis):
        axis.set_major_formatter(EngFormatter(sep=""))
    sizes = [g for _, d in data for g in d["outer"].get("group_size", []) if math.isfinite(g)]
    ax_group.set_ylim(0.5, max(sizes, default=2) + 0.5)
    ax_bytes.set_ylim(0, max(biggest / b_scale, 1.0) * 1.15)
    ax_tps.set_ylim(bottom=0)
    for ax in (ax_tok, ax_time):  # the first steps fall from ln(vocab); a log axis keeps the tail readable
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())

    fig.legend([Line2D([], [], color=colors[i % len(colors)], lw=3) for i in range(n)], [label for label, _ in data],
               loc="upper center", ncol=min(n, 8), bbox_to_anchor=(0.5, 0.955), frameon=False, fontsize=10)
    fig.suptitle(title, fontsize=14)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    try:
        fig.savefig(out, dpi=100)
    except (OSError, ValueError) as e:  # a missing or read-only dir; an extension matplotlib cannot write
        raise PlotError(f"cannot write {out}: {getattr(e, 'strerror', None) or e}") from None
    finally:
        plt.close(fig)


def _setup(ax, title: str, xlabel: str, ylabel: str, handles: Optional[list] = None,
           names: Optional[list] = None) -> None:
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if handles:
        ax.legend(handles, names, fontsize=8, loc="best")
