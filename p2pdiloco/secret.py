"""Keeping strangers out of a run: `--run-secret` (or P2PDILOCO_RUN_SECRET).

With a secret, a run's DHT keys and averaging namespace derive from HMAC(secret, run_id, model
fingerprint), every DHT record the peers write carries an HMAC that readers check, a peer must
show a token derived from the secret and its own peer id to join an averaging group, and state
downloads are served only to peers with a valid member record. One public record per run (a
verifier of the secret, itself an HMAC) lets a peer with a wrong secret fail with a clear error.

The threat model is in the README: a peer with the secret is trusted to follow the protocol
(the reducer-side contribution checks still bound what a faulty one does to the model); one
without it cannot read the run's DHT records, write them, join its groups or download its state.
"""

from __future__ import annotations

import hashlib
import hmac

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase

MAC_SIZE = 16


def _mac(secret: str, *parts: bytes) -> bytes:
    return hmac.new(secret.encode(), b"\x00".join(parts), hashlib.sha256).digest()


def secured_prefix(secret: str, run_id: str, fingerprint: str) -> str:
    return "p2pdiloco_s" + _mac(secret, b"prefix", run_id.encode(), fingerprint.encode()).hex()[:24]


def verifier(secret: str, run_id: str) -> str:
    """Public: lets a joiner tell a wrong secret from an empty swarm. Use a long random secret."""
    return _mac(secret, b"verify", run_id.encode()).hex()[:24]


def peer_token(secret: str, peer_id: str) -> str:
    """Shown in the gather when joining a group: proves the sender knows the secret."""
    return _mac(secret, b"peer", peer_id.encode()).hex()[:32]


def public_key(run_id: str) -> str:
    return f"p2pdiloco_{run_id}_secured"


class SecretValidator(RecordValidatorBase):
    """HMACs every DHT record this node writes and rejects records without a valid HMAC, except
    the run's one public verifier key."""

    def __init__(self, secret: str, run_id: str):
        self._secret = secret
        self._public = DHTID.generate(source=public_key(run_id)).to_bytes()

    def _tag(self, record: DHTRecord, value: bytes) -> bytes:
        return _mac(self._secret, record.key, record.subkey, value, repr(record.expiration_time).encode())[:MAC_SIZE]

    def sign_value(self, record: DHTRecord) -> bytes:
        if record.key == self._public:
            return record.value
        return record.value + self._tag(record, record.value)

    def validate(self, record: DHTRecord) -> bool:
        if record.key == self._public:
            return True
        if len(record.value) < MAC_SIZE:
            return False
        value, tag = record.value[:-MAC_SIZE], record.value[-MAC_SIZE:]
        return hmac.compare_digest(tag, self._tag(record, value))

    def strip_value(self, record: DHTRecord) -> bytes:
        if record.key == self._public:
            return record.value
        return record.value[:-MAC_SIZE]

    @property
    def priority(self) -> int:
        return 100  # sign last, validate first: the MAC covers what the other validators produced
