"""`init_from`: a swarm that starts from a pretrained Hugging Face model directory (saved in the
test with save_pretrained, offline). The weights' hash is part of the fingerprint; a joiner may
hold only the config and the hash."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from p2pdiloco import checkpoint
from p2pdiloco.config import Config, ConfigError
from p2pdiloco.model import build_model, flat_params
from tests.conftest import TINY

pytestmark = pytest.mark.timeout(180)
DEAD_PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


def save_gpt2(path, seed):
    import transformers

    torch.manual_seed(seed)
    conf = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(conf)
    model.save_pretrained(path, safe_serialization=True)
    return model


def test_weights_load_and_their_hash_is_in_the_fingerprint(tmp_path, corpus):
    """The model holds the saved weights; other weights change the fingerprint; a peer with only
    config.json and the right hash gets the founders' fingerprint; wrong or missing hashes are errors."""
    saved = save_gpt2(tmp_path / "a", seed=0)
    save_gpt2(tmp_path / "b", seed=1)
    (tmp_path / "c").mkdir()
    shutil.copy(tmp_path / "a" / "config.json", tmp_path / "c" / "config.json")
    base = {"data": str(corpus)}
    a = Config.from_sources(TINY, {**base, "init_from": str(tmp_path / "a")})
    b = Config.from_sources(TINY, {**base, "init_from": str(tmp_path / "b")})
    assert a.hf_config.endswith("a/config.json") and len(a.init_from_digest) == 64
    assert a.fingerprint() != b.fingerprint()
    model = build_model(a)
    torch.testing.assert_close(flat_params(model), torch.cat([p.detach().reshape(-1) for p in saved.parameters()]))
    joiner = {**base, "init_from": str(tmp_path / "c"), "initial_peers": [DEAD_PEER]}
    c = Config.from_sources(TINY, {**joiner, "init_from_sha256": a.init_from_digest})
    assert c.fingerprint() == a.fingerprint()
    with pytest.raises(ConfigError, match="no \\*.safetensors weights"):
        Config.from_sources(TINY, joiner)
    with pytest.raises(ConfigError, match="founding peer"):
        Config.from_sources(TINY, {**base, "init_from": str(tmp_path / "c"), "init_from_sha256": a.init_from_digest})
    with pytest.raises(ConfigError, match="not init_from_sha256"):
        Config.from_sources(TINY, {**base, "init_from": str(tmp_path / "a"), "init_from_sha256": b.init_from_digest})
    with pytest.raises(ConfigError, match="no config.json"):
        Config.from_sources(TINY, {**base, "init_from": str(tmp_path)})


def test_join_starts_from_the_pretrained_weights(tmp_path, corpus):
    """`p2pdiloco join --init-from DIR`: the anchor a peer starts from is the saved model's weights."""
    saved = save_gpt2(tmp_path / "gpt2", seed=0)
    flags = ["--config", TINY, "--data", str(corpus), "--init-from", str(tmp_path / "gpt2"), "--checkpoint-dir",
             str(tmp_path / "ckpt")]
    proc = subprocess.run([sys.executable, "-m", "p2pdiloco", "join", *flags, "--max-inner-steps", "5",
                           "--inner-steps", "50"], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert "--init-from-sha256" in proc.stderr  # the founder prints the hash a joiner without the weights needs
    cfg = Config.from_sources(TINY, {"data": str(corpus), "init_from": str(tmp_path / "gpt2")})
    payload, _, _ = checkpoint.load_latest(tmp_path / "ckpt", cfg)
    expected = torch.cat([p.detach().reshape(-1) for p in saved.parameters()])
    torch.testing.assert_close(payload["anchor"], expected)  # alone, no outer step: the anchor is the start
