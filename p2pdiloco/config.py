"""One typed config for a peer: TOML presets in `peers/`, overridden by command-line flags.

Every field has a help text (reused as the flag's help) and is checked in `__post_init__`.
The same name is used for a field, its TOML key (`inner_steps`), its flag (`--inner-steps`)
and the metrics that report it.

    >>> cfg = Config.from_sources("peers/tiny-cpu.toml", {"inner_steps": 20})
    >>> cfg.inner_steps
    20

Keys that must agree across a swarm (the model shape) go into `fingerprint()`, which is part of
the DHT prefix: peers with another model config or another `run_id` never meet. With `hf_config`
the model is a Hugging Face config (JSON) and the fingerprint hashes its content, not its path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A user-facing configuration problem; the CLI prints it on one line and exits 2."""


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


# Fields that name files or directories: a leading ~ is the user's home.
CODECS = ("none", "fp16", "int8", "int4")  # compression.py implements them; kept here so that the
# operator commands (status, prepare, ...) read a config without importing torch
PATH_KEYS = ("data", "shard_cache", "init_from", "hf_config", "log_dir", "maddrs_file", "identity_path",
             "checkpoint_dir", "tensorboard_dir", "initial_peers_file")
AGGREGATIONS = ("mean", "centered_clip")  # robust.py implements centered_clip

# Fields that define the model's shape: peers must agree on them to average together.
MODEL_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")


@dataclass
class Config:
    # --- identity of the run -------------------------------------------------------------
    run_id: str = _f("p2pdiloco", "Name of the training run; peers of different runs never average together.")
    run_secret: str = _f("", "Shared secret that keeps strangers out of the run (or env P2PDILOCO_RUN_SECRET); "
                             "never logged.")
    seed: int = _f(0, "Seed for the model init and this peer's data order (mixed with its peer id).")

    # --- model (a small GPT over bytes) --------------------------------------------------
    n_layer: int = _f(2, "Transformer blocks.")
    n_head: int = _f(4, "Attention heads per block.")
    n_embd: int = _f(64, "Embedding width.")
    block_size: int = _f(64, "Context length in tokens (bytes for text data).")
    vocab_size: int = _f(0, "Vocabulary size; 0 = the data's: its manifest's for prepared tokens, 256 for bytes.")
    dropout: float = _f(0.0, "Dropout probability inside the model.")
    hf_config: str = _f("", "A Hugging Face transformers model config (JSON file; relative paths are read next to "
                            "the preset) built with AutoModelForCausalLM.from_config instead of the built-in GPT; "
                            "needs the hf extra. No hub download.")
    init_from: str = _f("", "A local Hugging Face model directory (config.json and *.safetensors weights) to start "
                            "from: continued pretraining or fine-tuning. Its config is the model (hf_config); its "
                            "weights' sha256 joins the run's fingerprint. A joiner may hold only config.json and "
                            "pass init_from_sha256 (the founders print it); it downloads the anchor.")
    init_from_sha256: str = _f("", "The sha256 of init_from's weights, for a peer that does not hold them.")
    model_signature: str = _f("", "Set by the Python API (p2pdiloco.DiLoCo): a hash of the wrapped module's parameter "
                                  "names and shapes, part of the run's fingerprint.")

    # --- data ----------------------------------------------------------------------------
    data: str = _f("", "A directory made by `p2pdiloco prepare` (token shards and manifest.json), or a text file or "
                       "directory of .txt files trained on as bytes; empty = the bundled Shakespeare corpus.")
    data_order: str = _f("claims", "Prepared tokens: claims = each peer reads shards it claims through the DHT "
                                   "(disjoint data, epochs); random = windows drawn at random, like text data.")
    shards_per_peer: int = _f(4, "Prepared tokens with claims: shards a peer reads at once, a window from each in "
                                 "turn, so that its inner steps see more than one region of the corpus.")
    shard_cache: str = _f("", "Prepared tokens: where shards fetched from peers are kept (a peer needs only the "
                              "manifest); empty = ~/.cache/p2pdiloco/shards/<the manifest's digest>.")
    shard_cache_gb: float = _f(16.0, "Prepared tokens: the most GB of fetched shards kept on disk; the least recently "
                                     "used go first, the shards being read never.")
    eval_fraction: float = _f(0.05, "Fraction of the corpus held out for evaluation (the same for every peer).")
    batch_size: int = _f(16, "Sequences per inner step.")

    # --- inner loop (AdamW on the device) ------------------------------------------------
    inner_steps: int = _f(50, "H: inner steps between two contributions to the swarm.")
    inner_lr: float = _f(3e-3, "Peak AdamW learning rate.")
    warmup_steps: int = _f(50, "Linear warmup of the inner lr, in swarm inner steps (outer_step * inner_steps + local).")
    total_steps: int = _f(20000, "Inner steps of the cosine schedule (swarm position); the lr stays at min after.")
    min_lr_ratio: float = _f(0.1, "The cosine schedule ends at inner_lr * min_lr_ratio.")
    weight_decay: float = _f(0.1, "AdamW weight decay.")
    grad_clip: float = _f(1.0, "Clip the inner gradient norm to this value (0 = off).")

    # --- outer loop (Nesterov on CPU) ----------------------------------------------------
    outer_lr: float = _f(0.7, "Outer Nesterov learning rate (DiLoCo's 0.7; the tiny preset's 4 peers on a "
                              "schedule measured best at 1.0 with momentum 0.6, docs/benchmarks.md).")
    outer_momentum: float = _f(0.9, "Outer Nesterov momentum.")
    anchor_average: float = _f(0.1, "The model a peer keeps (its final evaluation, a checkpoint's `average`, "
                                    "export and sample) is a moving average of the anchors its outer steps made: "
                                    "their mean until there are 1/anchor_average of them, then this weight on each "
                                    "new one (latest weight averaging); 0 keeps the last anchor itself and no copy. "
                                    "One outer step moves the anchor's loss by several percent, the average far less "
                                    "(docs/security.md).")
    max_staleness: int = _f(4, "A peer this many outer steps behind the swarm reloads state instead of contributing.")
    group_share: bool = _f(False, "Experimental: scale a group's average by its share of the live swarm (members / "
                                  "live peers), so that several small groups move the anchor as far as one full "
                                  "group would (see docs/benchmarks.md).")
    anchor_tolerance: float = _f(
        1e-3, "Relative anchor difference within a round above which members count as diverged (and merge or "
              "resync)."
    )
    merge_anchors: bool = _f(True, "Members whose anchors differ average their anchors and outer momenta in the "
                                   "round (fp32, members at the newest outer step only) instead of discarding "
                                   "the round and downloading a state; a peer too stale also catches up this way.")
    eager_outer: bool = _f(True, "Eager outer updates: while a round runs, train from the anchor that our own "
                                  "pseudo-gradient would give, corrected when the group's average arrives.")
    eager_mix: bool = _f(False, "Experimental: the eager preview estimates the group's average as 1/N of our own "
                                "pseudo-gradient plus (N-1)/N of the outer momentum's running mean, N the live "
                                "peers (arXiv 2502.12996 mixes in the others' last average), instead of our "
                                "own pseudo-gradient alone.")
    dynamic_inner_steps: bool = _f(False, "Scale inner_steps by this peer's speed over the swarm's mean (from the "
                                          "progress records), so that every peer is due at the same moment.")
    full_groups: bool = _f(True, "A group forms as soon as every live peer (by their progress records) has "
                                 "joined it, instead of waiting out the matchmaking window.")
    schedule: bool = _f(True, "Rounds on a schedule: every member of a group leaves it with the same next due "
                              "time (one period of inner_steps at the group's median speed later) and enters "
                              "matchmaking then; peers out of phase take the swarm's phase from the progress "
                              "records (p2pdiloco/schedule.py).")
    grid: bool = _f(True, "With the schedule, past target_group_size live peers: groups are the lines of a "
                          "rotating grid (Moshpit SGD), so that every peer's work reaches every anchor within "
                          "ceil(log_g N) rounds (p2pdiloco/grid.py); off: whoever is ready in the window meets.")
    matchmaking_lead: bool = _f(False, "With full_groups: enter matchmaking ahead of the inner_steps-th step, by the "
                                       "mean wait for the group's last member (more outer steps per token). "
                                       "Measured worse: groups split more often (docs/benchmarks.md).")

    # --- averaging rounds (hivemind) -----------------------------------------------------
    target_group_size: int = _f(16, "Largest averaging group; whoever is ready in the window joins, up to this many.")
    min_group_size: int = _f(2, "Smallest group that may average; a peer alone keeps training and retries.")
    matchmaking_time: float = _f(2.5, "Seconds a round waits for peers to gather (the matchmaking window).")
    request_timeout: float = _f(1.5, "Seconds to wait for a group leader's answer; must be < matchmaking_time.")
    allreduce_timeout: float = _f(15.0, "Seconds an all-reduce may take once the group is formed.")
    next_chunk_timeout: float = _f(5.0, "Seconds without a chunk from a groupmate before it is dropped.")
    verdict_timeout: float = _f(5.0, "Seconds to wait for every member's verdict that its round was complete.")
    compression: str = _f("fp16", "Pseudo-gradient transport: none (fp32), fp16, int8 or int4 (blockwise, "
                                   "per-block scales, fp32 accumulation); the whole run must use the same.")
    max_norm_ratio: float = _f(
        10.0, "A contribution whose pseudo-gradient norm exceeds this many times the group median is excluded.")
    aggregation: str = _f("centered_clip", "How a reducer combines the members' parts: centered_clip (robust: a "
                                           "member far from the others pulls the average by at most the group's "
                                           "median distance; docs/security.md) or mean (hivemind's weighted "
                                           "mean). outer_apply = per_contribution always uses the mean.")
    check_reducers: bool = _f(True, "After each round, the members check by random projections that every reducer "
                                    "returned the aggregate of what it was sent, and discard a round that fails "
                                    "(fp16 and fp32 transport only: int8/int4 round the average by as much as the "
                                    "lies it catches).")
    ban_time: float = _f(600.0, "Seconds a peer whose contributions were excluded or clipped hard (or whose reducer "
                                "failed the check) in most of its last rounds with us is kept out of our groups "
                                "(0 = never).")
    state_timeout: float = _f(30.0, "Seconds to look for peers that share state when joining.")
    wait_for_peers: int = _f(0, "Before the first inner step, wait (up to bootstrap_timeout) until this many peers of "
                                "the run, this one included, have started: a swarm that starts together "
                                "(benchmarks). 0 = start at once.")
    sync_rounds: bool = _f(False, "Synchronous DiLoCo, a baseline: after every inner_steps, stop training until a "
                                  "round of min_group_size peers completes (set it to the swarm's size).")
    outer_apply: str = _f("group", "group: one Nesterov step per group average (right). per_contribution: one per "
                                   "member's pseudo-gradient, as naive async DiLoCo does (a negative control for "
                                   "benchmarks; sends target_group_size times more).")

    # --- network --------------------------------------------------------------------------
    initial_peers: list = _f([], "Multiaddrs of any live peers (or stock hivemind DHT nodes) to join through.")
    initial_peers_file: str = _f("", "File of initial peers' multiaddrs, one a line (what --maddrs-file writes; "
                                     "blank lines and # comments ignored), added to initial_peers. Read when the "
                                     "config is resolved.")
    host_maddrs: list = _f(["/ip4/0.0.0.0/tcp/0"], "Multiaddrs to listen on.")
    announce_maddrs: list = _f([], "Multiaddrs to announce to others (your public address).")
    identity_path: str = _f("", "Private key file for a stable peer id (created if missing).")
    client_mode: bool = _f(False, "Do not accept incoming connections (behind NAT); join others' groups only.")
    use_relay: bool = _f(True, "Allow connections through relays.")
    use_auto_relay: bool = _f(False, "Look for relays automatically when unreachable.")
    bootstrap_timeout: float = _f(20.0, "Seconds to reach the initial peers before giving up (dead ones are "
                                        "retried with backoff until then: start the peers in any order).")
    startup_timeout: float = _f(30.0, "Seconds the p2pd daemon may take to start (hivemind's 15 s is short on a "
                                      "loaded machine); connecting to the initial peers comes on top.")
    reachability: str = _f("auto", "auto: after joining, ask other peers to dial this one back; if none can, "
                                   "average as a client (send parts, reduce none: only outbound connections "
                                   "needed). public: skip the check, always reduce. client: the same as "
                                   "client_mode for averaging, the DHT stays a server.")

    # --- checkpoints -------------------------------------------------------------------------
    checkpoint_dir: str = _f("", "Directory for restartable checkpoints (written atomically; the last 2 are kept).")
    checkpoint_every: int = _f(5, "Write a checkpoint every this many applied outer steps (and at a clean stop).")

    # --- running ---------------------------------------------------------------------------
    device: str = _f("auto", "auto, cpu, cuda or cuda:N.")
    max_time: float = _f(0.0, "Stop cleanly after this many seconds (0 = run until interrupted).")
    max_inner_steps: int = _f(0, "Stop cleanly after this many local inner steps (0 = no limit).")
    log_dir: str = _f("", "Directory for metrics.jsonl and the resolved config.")
    log_interval: float = _f(5.0, "Seconds between status lines and inner metrics.")
    tensorboard_dir: str = _f("", "Also write the metrics as TensorBoard scalars here (needs the tensorboard extra).")
    wandb_project: str = _f("", "Also send the metrics to this Weights & Biases project (needs the wandb extra; "
                                "WANDB_MODE=offline keeps them local).")
    eval_batches: int = _f(4, "Held-out batches behind each evaluation of the anchor.")
    eval_every: int = _f(1, "Evaluate the anchor at most every this many outer steps (and at the end); eval "
                            "costs eval_batches forward passes, in a background thread.")
    eval_budget: float = _f(0.01, "The share of wall time the background evaluations may take (an evaluation is "
                                  "skipped while they took more); 0 = no limit. The final one always runs.")
    compile: str = _f("auto", "torch.compile the model for the inner steps: auto (on CUDA only), on, off.")
    maddrs_file: str = _f("", "Write this peer's visible multiaddrs here, one per line, once the DHT is up.")
    threads: int = _f(0, "torch CPU threads (0 = torch default).")
    slowdown: float = _f(1.0, "Benchmarks: make this peer N times slower by sleeping (N-1) times each inner "
                              "step's compute time (a simulated straggler).")

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        need(re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.run_id) is not None,
             f"run_id must be 1-64 letters, digits, '-' or '_', got {self.run_id!r}")
        for key in PATH_KEYS:  # presets may name files under ~ (the volunteer's identity and checkpoints)
            if getattr(self, key):
                setattr(self, key, os.path.expanduser(getattr(self, key)))
        self._manifest = _read_data_manifest(self.data)
        data_vocab = self._manifest.vocab_size if self._manifest else 256
        need(self.vocab_size >= 0, f"vocab_size must be >= 0, got {self.vocab_size}")
        self.vocab_size = self.vocab_size or data_vocab
        need(self.vocab_size >= data_vocab, f"vocab_size {self.vocab_size} is smaller than the data's vocabulary "
                                            f"({data_vocab}): leave vocab_size at 0 to take the data's")
        for key in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "batch_size", "inner_steps",
                    "target_group_size", "min_group_size", "eval_batches", "eval_every", "checkpoint_every",
                    "shards_per_peer"):
            need(getattr(self, key) >= 1, f"{key} must be >= 1, got {getattr(self, key)}")
        need(self.n_embd % self.n_head == 0, f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        need(self.min_group_size <= self.target_group_size, "min_group_size must be <= target_group_size")
        for key in ("inner_lr", "outer_lr", "matchmaking_time", "request_timeout", "allreduce_timeout",
                    "next_chunk_timeout", "verdict_timeout", "log_interval", "state_timeout", "bootstrap_timeout",
                    "startup_timeout", "max_norm_ratio"):
            value = getattr(self, key)
            need(math.isfinite(value) and value > 0, f"{key} must be a positive number, got {value}")
        for key in ("weight_decay", "grad_clip", "max_time", "warmup_steps", "total_steps", "max_inner_steps",
                    "max_staleness", "threads", "anchor_tolerance", "wait_for_peers", "ban_time"):
            value = getattr(self, key)
            need(math.isfinite(value) and value >= 0, f"{key} must be >= 0, got {value}")
        need(0 <= self.outer_momentum < 1, f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        need(0 <= self.anchor_average <= 1, f"anchor_average must be in [0, 1], got {self.anchor_average}")
        need(0 <= self.dropout < 1, f"dropout must be in [0, 1), got {self.dropout}")
        need(0 < self.eval_fraction < 0.5, f"eval_fraction must be in (0, 0.5), got {self.eval_fraction}")
        need(self.total_steps > self.warmup_steps,
             f"total_steps ({self.total_steps}) must exceed warmup_steps ({self.warmup_steps})")
        need(0 <= self.min_lr_ratio <= 1, f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        need(self.request_timeout < self.matchmaking_time,
             "request_timeout must be smaller than matchmaking_time (hivemind deadlocks otherwise)")
        need(self.compression in CODECS, f"compression must be one of {', '.join(CODECS)}, got {self.compression!r}")
        need(self.aggregation in AGGREGATIONS,
             f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {self.aggregation!r}")
        need(self.outer_apply in ("group", "per_contribution"),
             f"outer_apply must be group or per_contribution, got {self.outer_apply!r}")
        need(self.outer_apply == "group" or self.target_group_size <= 16,
             "outer_apply = per_contribution needs target_group_size <= 16 (it sends that many vectors)")
        need(math.isfinite(self.slowdown) and self.slowdown >= 1, f"slowdown must be >= 1, got {self.slowdown}")
        need(math.isfinite(self.eval_budget) and 0 <= self.eval_budget <= 1,
             f"eval_budget must be in [0, 1], got {self.eval_budget}")
        need(self.compile in ("auto", "on", "off"), f"compile must be auto, on or off, got {self.compile!r}")
        need(re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None, f"bad device {self.device!r}")
        need(math.isfinite(self.shard_cache_gb) and self.shard_cache_gb > 0,
             f"shard_cache_gb must be > 0, got {self.shard_cache_gb}")
        need(self.data_order in ("claims", "random"), f"data_order must be claims or random, got {self.data_order!r}")
        need(self.reachability in ("auto", "public", "client"),
             f"reachability must be auto, public or client, got {self.reachability!r}")
        for key in ("initial_peers", "host_maddrs", "announce_maddrs"):
            value = getattr(self, key)
            need(isinstance(value, list) and all(isinstance(v, str) for v in value),
                 f"{key} must be a list of multiaddr strings")
            for addr in value:
                check_multiaddr(addr, key)
        need(len(self.host_maddrs) > 0, "host_maddrs must not be empty")
        if self.initial_peers_file:  # merged here, so that every reader of initial_peers sees them
            self.initial_peers = list(dict.fromkeys([*self.initial_peers, *read_peers_file(self.initial_peers_file)]))
        self._init_sha = _init_from(self) if self.init_from else ""
        # the parsed HF config: read once, so the fingerprint and the model come from the same bytes
        self._hf_json = _read_hf_json(self.hf_config, self.vocab_size, self.block_size) if self.hf_config else None

    # ---------------------------------------------------------------------------------------

    @classmethod
    def from_sources(cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> "Config":
        """Read a TOML preset (tables are only for grouping), then apply overrides; unknown keys are errors."""
        values: dict[str, Any] = {}
        if path:
            try:
                raw = tomllib.loads(Path(path).read_text())
            except FileNotFoundError:
                raise ConfigError(f"config file not found: {path}") from None
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(f"cannot read config {path}: {e}") from None
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"bad TOML in {path}: {e}") from None
            values.update(_flatten(raw, str(path)))
        # a relative hf_config path is read next to the preset that names it, or from the cwd for a flag
        base = Path.cwd() if "hf_config" in (overrides or {}) else Path(path or ".").parent
        values.update(overrides or {})
        if isinstance(values.get("hf_config"), str) and values["hf_config"]:
            values["hf_config"] = str(_expand(values["hf_config"], base=base))
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"unknown config key(s): {', '.join(unknown)}")
        for name, value in values.items():
            values[name] = _coerce(name, value, known[name].default if known[name].default is not dataclasses.MISSING else [])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The resolved config, as written next to the logs: the run secret is redacted."""
        d = dataclasses.asdict(self)
        if d["run_secret"]:
            d["run_secret"] = "<redacted>"
        return d

    def __repr__(self) -> str:  # never show the secret in a traceback or a log line
        return f"Config({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"

    @property
    def init_from_digest(self) -> str:
        """The sha256 of init_from's weights ("" without init_from)."""
        return self._init_sha

    @property
    def hf_json(self) -> dict[str, Any] | None:
        """The `hf_config` file's JSON object (a copy), or None for the built-in GPT."""
        return None if self._hf_json is None else json.loads(json.dumps(self._hf_json))

    def fingerprint(self) -> str:
        """Hash of what peers must share to average together: run id, model shape and the wire format."""
        shared = {"run_id": self.run_id, **{k: getattr(self, k) for k in MODEL_KEYS}}
        if self._hf_json is not None:  # the HF config replaces the GPT's shape keys; data shape stays
            canonical = json.dumps(self._hf_json, sort_keys=True, separators=(",", ":"))
            shared = {"run_id": self.run_id, "vocab_size": self.vocab_size, "block_size": self.block_size,
                      "hf_config": hashlib.sha256(canonical.encode()).hexdigest()}
        if self.model_signature:  # a caller's own module (the Python API): its shapes, not the GPT's keys
            shared = {"run_id": self.run_id, "model_signature": self.model_signature}
        if self.compression in ("int8", "int4") or self.outer_apply != "group":  # fp16 and fp32 interoperate
            shared.update(compression=self.compression, outer_apply=self.outer_apply)
        if self.aggregation != "centered_clip" or not self.check_reducers:  # every reducer must use the same rule
            shared.update(aggregation=self.aggregation, check_reducers=self.check_reducers)
        if not self.grid:  # past one group, peers with and without the grid look for groups under other keys
            shared.update(grid=False)
        if not self.merge_anchors:  # the averaged buffer has another shape: such peers cannot meet
            shared.update(merge_anchors=False)
        if self._init_sha:  # pretrained weights: every founder starts from the same ones
            shared.update(init_from=self._init_sha[:16])
        if self._manifest is not None:  # prepared tokens: the same tokenizer and shards on every peer
            shared.update(data=self._manifest.digest[:16])
        return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:12]

    @property
    def shard_cache_dir(self) -> str:
        """Where shards fetched from peers go: shard_cache, or one folder per prepared dataset."""
        if self.shard_cache or self._manifest is None:
            return self.shard_cache
        base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        return os.path.join(base, "p2pdiloco", "shards", self._manifest.digest[:16])

    @property
    def dht_prefix(self) -> str:
        if self.run_secret:
            from p2pdiloco.secret import secured_prefix

            return secured_prefix(self.run_secret, self.run_id, self.fingerprint())
        return f"p2pdiloco_{self.run_id}_{self.fingerprint()}"


def help_for(name: str) -> str:
    return next(f.metadata["help"] for f in dataclasses.fields(Config) if f.name == name)


def check_multiaddr(addr: str, what: str = "multiaddr") -> None:
    from hivemind.utils.multiaddr import Multiaddr  # vendored by hivemind

    try:
        Multiaddr(addr)
    except Exception as e:  # the library raises several unrelated types
        raise ConfigError(f"malformed {what} {addr!r}: {e}") from None


def read_peers_file(path: str) -> list[str]:
    """The multiaddrs in a file, one a line (what --maddrs-file writes); blank lines and # comments skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        raise ConfigError(f"initial_peers_file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read initial_peers_file {path}: {getattr(e, 'strerror', None) or e}") from None
    addrs = []
    for number, line in enumerate(lines, 1):
        addr = line.split("#", 1)[0].strip()
        if not addr:
            continue
        try:
            check_multiaddr(addr)
        except ConfigError as e:
            raise ConfigError(f"initial_peers_file {path} line {number}: {e}") from None
        if "/p2p/" not in addr:
            raise ConfigError(f"initial_peers_file {path} line {number}: {addr!r} has no /p2p/<peer id> part")
        addrs.append(addr)
    if not addrs:
        raise ConfigError(f"no multiaddrs in initial_peers_file {path}")
    return addrs


def _expand(value: str, *, base: Path) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else (base / path).absolute()


_WEIGHT_HASHES: dict[tuple, str] = {}  # (path, size, mtime) -> sha256: Config is built more than once


def weight_files(directory: str) -> list[Path]:
    return sorted(Path(directory).glob("*.safetensors"))


def _init_from(cfg) -> str:
    """Check `init_from`, point hf_config at its config.json, and return its weights' sha256 (or
    the one given by init_from_sha256 for a peer without the weights)."""
    root = Path(cfg.init_from)
    if not (root / "config.json").is_file():
        raise ConfigError(f"init_from {cfg.init_from} is not a model directory (no config.json)")
    config = str((root / "config.json").absolute())
    if cfg.hf_config and os.path.abspath(cfg.hf_config) != config:
        raise ConfigError("init_from names its own model config: leave hf_config empty")
    cfg.hf_config = config
    given = cfg.init_from_sha256.lower()
    if given and re.fullmatch(r"[0-9a-f]{64}", given) is None:
        raise ConfigError(f"init_from_sha256 must be 64 hex digits, got {cfg.init_from_sha256!r}")
    files = weight_files(cfg.init_from)
    if not files:
        if not given:
            raise ConfigError(f"init_from {cfg.init_from} holds no *.safetensors weights: a peer without them "
                              f"passes --init-from-sha256 (the founders print it when they start)")
        if not cfg.initial_peers:
            raise ConfigError(f"init_from {cfg.init_from} holds no weights: a founding peer (no initial_peers) "
                              f"needs them; a joiner downloads the swarm's state instead")
        return given
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        key = (str(f.absolute()), st.st_size, st.st_mtime_ns)
        if key not in _WEIGHT_HASHES:
            fh = hashlib.sha256()
            with open(f, "rb") as src:
                while block := src.read(1 << 22):
                    fh.update(block)
            _WEIGHT_HASHES[key] = fh.hexdigest()
        h.update(f.name.encode() + b"\0" + _WEIGHT_HASHES[key].encode())
    sha = h.hexdigest()
    if given and given != sha:
        raise ConfigError(f"init_from {cfg.init_from}: its weights' sha256 is {sha}, not init_from_sha256 {given}")
    return sha


def _read_data_manifest(data: str):
    """The manifest when `data` is a prepared directory (None for text); a bad one is a ConfigError.
    A built-in dataset's name (data/builtin.py) gives its vocabulary and digest, prepared or not."""
    from p2pdiloco.data.builtin import BUILTIN

    if data in BUILTIN and not os.path.exists(data):
        return BUILTIN[data]
    if not data or not os.path.isdir(data) or not os.path.exists(os.path.join(data, "manifest.json")):
        return None
    from p2pdiloco.data.manifest import ManifestError, read_manifest

    try:
        return read_manifest(data)
    except ManifestError as e:
        raise ConfigError(str(e)) from None


def _read_hf_json(path: str, vocab_size: int, block_size: int) -> dict[str, Any]:
    """Read and check an `hf_config` file without importing transformers (hf.py checks the rest)."""
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"hf_config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read hf_config {path}: {getattr(e, 'strerror', None) or e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"bad JSON in hf_config {path}: {e}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise ConfigError(f'hf_config {path} must be a JSON object with a "model_type" string')
    if "vocab_size" in raw and raw["vocab_size"] != vocab_size:
        raise ConfigError(f"hf_config {path}: vocab_size is {raw['vocab_size']!r}, the data needs "
                          f"vocab_size = {vocab_size}")
    max_pos = raw.get("max_position_embeddings")
    if max_pos is not None and not (isinstance(max_pos, int) and max_pos >= block_size):
        raise ConfigError(f"hf_config {path}: max_position_embeddings ({max_pos!r}) must be >= block_size "
                          f"({block_size})")
    return raw


def _flatten(raw: dict[str, Any], where: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        items = value.items() if isinstance(value, dict) else [(key, value)]
        for k, v in items:
            if isinstance(v, dict):
                raise ConfigError(f"{where}: nested table {key}.{k} is not allowed")
            if k in flat:
                raise ConfigError(f"{where}: key {k} given twice")
            flat[k] = v
    return flat


def _coerce(name: str, value: Any, default: Any) -> Any:
    kind = type(default)
    try:
        if kind is bool:
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            if not isinstance(value, bool):
                raise ValueError(value)
            return value
        if kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if kind is float:
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if kind is list:
            if isinstance(value, str):
                return [v for v in value.split(",") if v]
            if not isinstance(value, list):
                raise ValueError(value)
            return list(value)
        if kind is str:
            if not isinstance(value, str):
                raise ValueError(value)
            return value
    except (TypeError, ValueError):
        raise ConfigError(f"{name} expects a {kind.__name__}, got {value!r}") from None
    return value
