"""Optional metric sinks next to metrics.jsonl: TensorBoard scalars and Weights & Biases.

Each is imported only when asked for (`--tensorboard-dir`, `--wandb-project`); a missing package or
a W&B run that cannot start is a one-line ConfigError at startup. The scalars, by event:

    inner  x = inner_step   inner/loss, inner/tokens_per_s
    outer  x = outer_step   outer/eval_loss, outer/group_size, outer/round_s, outer/bytes_sent, outer/bytes_recv

    >>> sink = TensorBoardSink("runs/tb", peer=peer_id)   # writes runs/tb/<peer id>/events.out.tfevents.*
    >>> sink.write("inner", 120, {"inner/loss": 2.31}, walltime=time.time())
    >>> sink.close()

TensorBoard: one subdirectory per peer, named by its peer id, so peers may share a directory and
`tensorboard --logdir runs/tb` shows one run per peer. W&B: one run per peer (name = peer id,
group = run_id, config = the resolved config, secret redacted); `WANDB_MODE=offline` keeps it on
disk (under `$WANDB_DIR`, else the log dir) for a later `wandb sync`. Console capture is off: the
peer forks hivemind's processes after the sink starts, and they must not write through W&B's pipe.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from p2pdiloco.config import ConfigError

# event -> (the x-axis field, the fields plotted against it)
SCALARS = {
    "inner": ("inner_step", ("loss", "tokens_per_s")),
    "outer": ("outer_step", ("eval_loss", "group_size", "round_s", "bytes_sent", "bytes_recv")),
}


def scalars(event: str, record: dict) -> Optional[tuple[int, dict[str, float]]]:
    """(step, {tag: value}) of a metrics record, or None for an event without scalars."""
    if event not in SCALARS:
        return None
    x, fields = SCALARS[event]
    values = {f"{event}/{k}": float(record[k]) for k in fields if isinstance(record.get(k), (int, float))}
    return int(record[x]), values


class TensorBoardSink:
    name = "TensorBoard"

    def __init__(self, log_dir: str, *, peer: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("--tensorboard-dir needs the tensorboard package: "
                              "pip install 'p2pdiloco[tensorboard]'") from None
        self.writer = SummaryWriter(log_dir=str(Path(log_dir) / peer))

    def write(self, event: str, step: int, values: dict[str, float], *, walltime: float) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step, walltime=walltime)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    name = "W&B"

    def __init__(self, project: str, *, peer: str, run_config: Optional[dict], log_dir: Optional[str]):
        try:
            import wandb
        except ImportError:
            raise ConfigError("--wandb-project needs the wandb package: pip install 'p2pdiloco[wandb]'") from None
        self.wandb = wandb
        run_config = run_config or {}
        try:
            self.run = wandb.init(project=project, name=peer, group=run_config.get("run_id"), config=run_config,
                                  dir=None if os.environ.get("WANDB_DIR") else log_dir,
                                  settings=wandb.Settings(console="off"))
        except Exception as e:  # no login, no network, a bad project name: say so before training
            wandb.teardown()
            detail = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"W&B run did not start: {detail} (WANDB_MODE=offline keeps runs on disk)") from None
        for event in SCALARS:  # each event's scalars against its own step counter
            self.run.define_metric(f"{event}/step")
            self.run.define_metric(f"{event}/*", step_metric=f"{event}/step")

    def write(self, event: str, step: int, values: dict[str, float], *, walltime: float) -> None:
        self.run.log({f"{event}/step": step, **values})

    def close(self) -> None:
        try:
            self.run.finish()
        finally:
            self.wandb.teardown()  # stops the wandb-core service process; our CLI exits without atexit hooks


def check_installed(*, tensorboard_dir: str = "", wandb_project: str = "") -> None:
    """Before the swarm is joined: a ConfigError when a sink asked for is not installed at all
    (an install that fails on import is caught when the sink starts)."""
    import importlib.util

    for asked, package, flag in ((tensorboard_dir, "tensorboard", "--tensorboard-dir"),
                                 (wandb_project, "wandb", "--wandb-project")):
        if asked and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{flag} needs the {package} package: pip install 'p2pdiloco[{package}]'")


def open_sinks(*, peer: str, tensorboard_dir: str = "", wandb_project: str = "", run_config: Optional[dict] = None,
               log_dir: Optional[str] = None) -> list:
    """The sinks asked for, started; none is left open if one fails to start."""
    sinks = []
    try:
        if tensorboard_dir:
            sinks.append(TensorBoardSink(tensorboard_dir, peer=peer))
        if wandb_project:
            sinks.append(WandbSink(wandb_project, peer=peer, run_config=run_config, log_dir=log_dir))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks
