"""Bring your own model: DiLoCo over the swarm for any `nn.Module`, inner optimizer and data.

In the spirit of `hivemind.Optimizer`, you keep your training loop and add one call after each
inner optimizer step. Every `inner_steps` calls the pseudo-gradient (anchor - local weights)
goes to a background averaging round with whichever peers are ready; when a round comes back,
one outer Nesterov step moves the anchor and your model's weights follow it (keeping the steps
made while the round ran). Your optimizer, learning-rate schedule, data and loss stay yours.

    >>> torch.manual_seed(0)                       # every peer of a run starts from the same init
    >>> model = MyModel()
    >>> inner_opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    >>> with DiLoCo(model, inner_opt, run_id="my-run", initial_peers=[...], inner_steps=100) as diloco:
    ...     for x, y in batches:
    ...         loss = F.mse_loss(model(x), y)
    ...         loss.backward()
    ...         inner_opt.step()
    ...         inner_opt.zero_grad()
    ...         diloco.step(loss, tokens=len(x))   # True when an outer step moved the weights

or, with a data iterator and a loss function, `train(model, inner_opt, batches, loss_fn, ...)`.

Every `join` config key is a keyword here (`outer_lr=0.7`, `log_dir="runs/a"`,
`checkpoint_dir=...`, `host_maddrs=[...]`); `config="peers/x.toml"` reads a preset first. Peers
average only with peers whose model has the same parameter names and shapes (a signature of the
module is part of the run's fingerprint). Tuning: `inner_steps` so that a round (a few seconds on
the internet) overlaps many steps; `outer_lr` 0.5 with `outer_momentum` 0.9 measured best for 4
peers of the tiny preset over long runs (docs/benchmarks.md).
"""

from __future__ import annotations

import hashlib
import signal
import threading
import time
from typing import Any, Callable, Iterable, Optional

import torch

from p2pdiloco import progress
from p2pdiloco.config import Config
from p2pdiloco.model import load_flat_
from p2pdiloco.peer import Peer


def module_signature(model: torch.nn.Module) -> str:
    """Hash of the parameter names, shapes and dtypes: what peers must share to average."""
    desc = ";".join(f"{name}:{tuple(p.shape)}:{p.dtype}" for name, p in model.named_parameters())
    return hashlib.sha256(desc.encode()).hexdigest()[:12]


class DiLoCo:
    """One peer of a swarm around a model you train yourself; see the module docstring.

    start() (called by the constructor) joins the swarm and, when another peer shares state,
    loads the swarm's current anchor into `model` before you train. close() (or leaving the
    `with` block) lets the last round land, logs the final record, writes a checkpoint when
    `checkpoint_dir` is set, and stops the DHT, the averager and their processes.
    """

    def __init__(self, model: torch.nn.Module, inner_opt: torch.optim.Optimizer, *, run_id: str,
                 initial_peers: Iterable[str] = (), config: Optional[str] = None,
                 eval_fn: Optional[Callable[[torch.nn.Module], float]] = None, quiet: bool = True, **overrides: Any):
        overrides = dict(overrides, run_id=run_id, initial_peers=list(initial_peers),
                         model_signature=module_signature(model))
        self.cfg = Config.from_sources(config, overrides)
        progress.configure(quiet=quiet)
        self.model = model
        self.peer = Peer(self.cfg, quiet=quiet, model=model, inner_opt=inner_opt, eval_fn=eval_fn,
                         handle_signals=False)
        in_main = threading.current_thread() is threading.main_thread()
        sigint = signal.getsignal(signal.SIGINT) if in_main else None
        try:
            self.peer.start()
        except BaseException:
            self.peer.close()
            raise
        finally:
            if in_main:  # hivemind's averager ignores SIGINT in our process when it starts: give Ctrl-C back
                signal.signal(signal.SIGINT, sigint)
        self._closed = False
        self._returned = time.monotonic()

    def step(self, loss: Optional[torch.Tensor] = None, tokens: int = 1) -> bool:
        """Call once after each inner optimizer step. `loss` (optional, for the logs) and `tokens`
        (the batch's tokens or samples: a contribution's weight in the average). Returns True when
        an outer step was applied: the model's weights moved."""
        if self._closed:
            raise RuntimeError("this DiLoCo peer is closed")
        now = time.monotonic()
        self.peer.timer.total_s += now - self._returned  # your step, data loading included
        applied = self.peer.after_step(None if loss is None else loss.detach().float(), int(tokens))
        self._returned = time.monotonic()
        return applied

    @property
    def outer_step(self) -> int:
        return self.peer.outer_step

    @property
    def inner_step(self) -> int:
        return self.peer.inner_step

    @property
    def peer_id(self) -> str:
        return self.peer.peer_id

    @property
    def maddrs(self) -> list[str]:
        """This peer's multiaddrs: pass one to other peers as an initial peer."""
        return list(self.peer.maddrs)

    def load_anchor_(self, module: Optional[torch.nn.Module] = None) -> None:
        """Copy the anchor (the swarm's model, as of the last outer step) into module (default: ours)."""
        with self.peer.outer.lock:
            load_flat_(module or self.model, self.peer.outer.anchor)

    def load_kept_(self, module: Optional[torch.nn.Module] = None) -> None:
        """Copy the model this peer keeps (the moving average of its anchors, `anchor_average`; the anchor
        itself when that is 0) into module (default: ours): the one to keep at the end of a run."""
        with self.peer.outer.lock:
            load_flat_(module or self.model, self.peer.outer.kept())

    def close(self, *, finish: bool = True) -> None:
        """Stop; with finish (the default) first let the last round land and write the final record."""
        if self._closed:
            return
        self._closed = True
        try:
            if finish:
                self.peer.finish_training()
        finally:
            self.peer.close()

    def __enter__(self) -> "DiLoCo":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(finish=exc_type is None)


def train(model: torch.nn.Module, inner_opt: torch.optim.Optimizer, batches: Iterable[Any],
          loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], *, max_steps: int = 0,
          tokens_fn: Callable[[Any], int] = lambda batch: 1, **kwargs: Any) -> int:
    """The plain loop around DiLoCo: for each batch, loss_fn(model, batch), backward, inner step,
    zero_grad, diloco.step. Stops after max_steps (0 = when batches run out); returns the outer step.
    kwargs go to DiLoCo (run_id, initial_peers, config keys)."""
    with DiLoCo(model, inner_opt, **kwargs) as diloco:
        for i, batch in enumerate(batches):
            if max_steps and i >= max_steps:
                break
            loss = loss_fn(model, batch)
            loss.backward()
            inner_opt.step()
            inner_opt.zero_grad(set_to_none=True)
            diloco.step(loss, tokens=tokens_fn(batch))
        return diloco.outer_step
