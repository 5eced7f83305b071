"""p2pdiloco: decentralized DiLoCo training over a hivemind swarm (no coordinator, no rank 0)."""

__version__ = "0.1.0"

__all__ = ["DiLoCo", "train", "SwarmError", "ConfigError"]
_HOMES = {"DiLoCo": "p2pdiloco.api", "train": "p2pdiloco.api", "SwarmError": "p2pdiloco.swarm",
          "ConfigError": "p2pdiloco.config"}


def __getattr__(name: str):
    """The Python API (`p2pdiloco.DiLoCo`, `p2pdiloco.train`) and its errors, imported on first
    use so that the CLI's operator commands start without torch and hivemind."""
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'p2pdiloco' has no attribute {name!r}")
