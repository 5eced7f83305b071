"""p2pdiloco: decentralized DiLoCo training over a hivemind swarm (no coordinator, no rank 0)."""

__version__ = "0.1.0"
