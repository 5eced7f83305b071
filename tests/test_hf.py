"""Hugging Face models from a config file (`hf_config`): a real 2-peer swarm on the tiny-llama
preset, the CLI's one-line errors, the same init on every peer, and the fingerprint that keys the
swarm on the config's content. Nothing is fetched: HF_HUB_OFFLINE=1 in every process.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from p2pdiloco.config import Config, ConfigError
from p2pdiloco.localswarm import LocalSwarm, group_members
from p2pdiloco.model import build_model, flat_params, num_params
from tests.conftest import ROOT, TINY, evaluated

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
LLAMA = str(ROOT / "peers" / "tiny-llama.toml")
LLAMA_JSON = ROOT / "peers" / "hf" / "tiny-llama.json"
RANDOM_INIT_LOSS = math.log(256)


@pytest.fixture(autouse=True)
def offline_one_thread(monkeypatch):
    """This process builds models too (transformers is imported lazily, so it reads these), on one
    thread: two torch threads on two shared cores crawl when other tests' peers run."""
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _batch(seed: int = 0, batch: int = 4, block: int = 64):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (batch, block + 1), generator=gen)
    return x[:, :-1], x[:, 1:]


# --------------------------------------------------------------------------- a real swarm

@pytest.mark.timeout(180)
def test_two_llama_peers_average_and_loss_falls(tmp_path, corpus):
    def trained(name: str) -> bool:
        outer = swarm.events(name, "outer")
        losses = [r["eval_loss"] for r in evaluated(outer)]
        return len(outer) >= 2 and bool(losses) and losses[-1] < RANDOM_INIT_LOSS - 1.0

    def evals_at_shared_steps() -> dict[int, list[float]]:
        """Eval losses at the outer steps both peers evaluated (b joins later, so its first evals
        can fall on steps a evaluated before b's outer events began)."""
        by_step: dict[int, list[float]] = {}
        for name in "ab":
            for r in evaluated(swarm.events(name, "outer")):
                by_step.setdefault(r["outer_step"], []).append(r["eval_loss"])
        return {k: v for k, v in by_step.items() if len(v) == 2}

    with LocalSwarm(tmp_path, config=LLAMA, extra_args=["--data", str(corpus), "--inner-steps", "30"],
                    env=OFFLINE) as swarm:
        swarm.start("a")
        swarm.start("b", join="a")
        swarm.wait_for(lambda: all(trained(n) for n in "ab") and len(evals_at_shared_steps()) >= 2, timeout=150,
                       what="2 outer steps, an eval loss 1 below random init on both peers, evals at 2 shared steps")
        for name in "ab":
            outer = swarm.events(name, "outer")
            assert all(r["group_size"] == 2 for r in outer), outer
            assert all(r["diverged_members"] == 0 and r["anchor_spread"] < 1e-3 for r in outer), outer
            assert "Traceback" not in swarm.stderr(name, tail=20000)
        inner_a = swarm.events("a", "inner")  # a started the swarm from the seeded init
        assert inner_a[-1]["loss"] < inner_a[0]["loss"] - 0.5, (inner_a[0]["loss"], inner_a[-1]["loss"])
        # both peers apply the same rounds to the same anchor: equal eval losses at equal outer steps
        shared = evals_at_shared_steps()
        assert len(shared) >= 2, shared
        for step, losses in shared.items():
            assert abs(losses[0] - losses[1]) < 0.02, (step, losses)
        resolved = json.loads((tmp_path / "a" / "config.json").read_text())
        assert resolved["hf_config"] == str(LLAMA_JSON)  # read next to the preset, written absolute
        assert swarm.stop_all(timeout=30) == {"a": 0, "b": 0}
        assert all(swarm.events(name, "final") for name in "ab")


# ----------------------------------------------------------------------- CLI errors: exit 2

BAD_JSON = {
    "missing": (None, "hf_config file not found"),
    "bad_json": ('{"model_type": "llama", "vocab_size": 256,', "bad JSON in hf_config"),
    "vocab": ('{"model_type": "llama", "vocab_size": 32000}', "vocab_size is 32000"),
    "model_type": ('{"model_type": "no_such_model", "vocab_size": 256}', "unknown model_type 'no_such_model'"),
    "key": ('{"model_type": "llama", "vocab_size": 256, "n_embd": 64}', "unknown key(s) for model_type 'llama': n_embd"),
}


@pytest.mark.timeout(120)
def test_bad_hf_config_exits_2_before_the_dht(tmp_path, corpus):
    """Each case is a real `p2pdiloco join`; they run side by side (each is mostly imports)."""
    procs = {}
    try:
        for case, (text, _) in BAD_JSON.items():
            path = tmp_path / f"{case}.json"
            if text is not None:
                path.write_text(text)
            cmd = [sys.executable, "-m", "p2pdiloco", "join", "--config", LLAMA, "--hf-config", str(path),
                   "--data", str(corpus), "--maddrs-file", str(tmp_path / f"{case}.maddrs"),
                   "--log-dir", str(tmp_path / case)]
            procs[case] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                           stdin=subprocess.DEVNULL, env={**os.environ, **OFFLINE},
                                           start_new_session=True)
        for case, proc in procs.items():
            _, stderr = proc.communicate(timeout=90)
            assert proc.returncode == 2, (case, stderr)
            lines = stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("p2pdiloco: error: "), (case, stderr)
            assert BAD_JSON[case][1] in lines[0], (case, lines[0])
            # it failed before the DHT came up (no address written) and left nothing running
            assert not (tmp_path / f"{case}.maddrs").exists() and "up at" not in stderr, case
            assert group_members(proc.pid) == [], case
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


# -------------------------------------------------------------------------- the model itself

def test_same_init_in_every_process(tmp_path):
    cfg = Config.from_sources(LLAMA)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    local = flat_params(model)
    assert 50_000 < num_params(model) < 200_000
    code = ("import sys, torch; from p2pdiloco.config import Config; from p2pdiloco.model import build_model, "
            "flat_params; cfg = Config.from_sources(sys.argv[1]); torch.manual_seed(cfg.seed); "
            "torch.save(flat_params(build_model(cfg)), sys.argv[2])")
    out = tmp_path / "init.pt"
    subprocess.run([sys.executable, "-c", code, LLAMA, str(out)], check=True, timeout=60, cwd=ROOT,
                   env={**os.environ, **OFFLINE, "OMP_NUM_THREADS": "1"}, stdin=subprocess.DEVNULL)
    assert torch.equal(torch.load(out), local)
    torch.manual_seed(cfg.seed + 1)
    assert not torch.equal(flat_params(build_model(cfg)), local)


def test_model_contract_and_bf16_autocast():
    cfg = Config.from_sources(LLAMA)
    torch.manual_seed(0)
    model = build_model(cfg)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    x, y = _batch()
    loss = model(x, y)
    assert loss.shape == () and abs(loss.item() - RANDOM_INIT_LOSS) < 0.2  # near uniform at init
    # the loss is the cross-entropy of the logits against our targets as given (no shift inside)
    logits = model.lm(input_ids=x).logits
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
    assert torch.allclose(loss, ref, atol=1e-6)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):  # CUDA peers train under bf16 autocast
        bf16 = model(x, y)
    assert bf16.dtype == torch.float32 and abs(bf16.item() - loss.item()) < 0.05
    bf16.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(20):
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
    assert model(x, y).item() < loss.item() - 1.0  # it learns


def test_hub_config_dtype_is_ignored(tmp_path):
    """A hub config.json says bf16 and uses legacy rope keys: parameters stay fp32, the keys are accepted."""
    raw = json.loads(LLAMA_JSON.read_text())
    raw.update(torch_dtype="bfloat16", rope_theta=10000.0, architectures=["LlamaForCausalLM"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    model = build_model(Config(hf_config=str(path)))
    assert all(p.dtype == torch.float32 for p in model.parameters())


TINY_LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "num_attention_heads": 4,
              "num_hidden_layers": 1, "intermediate_size": 64}


@pytest.mark.parametrize("change, match", [
    ({"num_attention_heads": 5}, "not a multiple"),             # transformers' own validation
    ({"hidden_size": "wide"}, "hidden_size"),                   # a value of the wrong type
    ({"num_key_value_heads": 3}, "cannot build a causal LM"),   # builds, then fails the 8-token forward
    ({"model_type": "clip"}, "unknown key"),                    # no vocab_size at the top: not a causal LM
    ({"vocab_size": None}, "vocab_size is 32000"),              # left out: llama's default
])
def test_bad_model_configs_are_one_line_errors(tmp_path, change, match):
    raw = {**TINY_LLAMA, **change}
    raw = {k: v for k, v in raw.items() if v is not None}
    path = tmp_path / "m.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=match) as e:
        build_model(Config(hf_config=str(path)))
    assert "\n" not in str(e.value)


def test_architecture_without_sdpa_falls_back_to_eager(tmp_path):
    path = tmp_path / "bloom.json"
    path.write_text(json.dumps({"model_type": "bloom", "vocab_size": 256, "hidden_size": 64, "n_layer": 2,
                                "n_head": 4}))
    model = build_model(Config(hf_config=str(path)))
    assert model.lm.config._attn_implementation == "eager"
    x, y = _batch()
    assert torch.isfinite(model(x, y))


def test_max_position_embeddings_checked(tmp_path):
    raw = json.loads(LLAMA_JSON.read_text())
    raw["max_position_embeddings"] = 32
    path = tmp_path / "short.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        Config(hf_config=str(path), block_size=64)
    Config(hf_config=str(path), block_size=32)


# ------------------------------------------------------------------------------- fingerprint

def test_fingerprint_follows_the_content_not_the_path(tmp_path):
    base = Config.from_sources(LLAMA)
    copy = tmp_path / "elsewhere" / "llama.json"
    copy.parent.mkdir()
    shutil.copy(LLAMA_JSON, copy)
    assert Config.from_sources(LLAMA, {"hf_config": str(copy)}).fingerprint() == base.fingerprint()
    # key order and whitespace do not matter either
    reordered = tmp_path / "reordered.json"
    reordered.write_text(json.dumps(dict(reversed(list(json.loads(LLAMA_JSON.read_text()).items()))), indent=4))
    assert Config.from_sources(LLAMA, {"hf_config": str(reordered)}).fingerprint() == base.fingerprint()

    wider = json.loads(LLAMA_JSON.read_text())
    wider["intermediate_size"] = 256
    other = tmp_path / "wider.json"
    other.write_text(json.dumps(wider))
    changed = Config.from_sources(LLAMA, {"hf_config": str(other)})
    assert changed.fingerprint() != base.fingerprint()
    assert changed.dht_prefix != base.dht_prefix
    # the built-in GPT's shape keys no longer matter; the data shape does
    assert Config.from_sources(LLAMA, {"n_layer": 6}).fingerprint() == base.fingerprint()
    assert Config.from_sources(LLAMA, {"block_size": 32}).fingerprint() != base.fingerprint()
    tiny = Config.from_sources(TINY, {"run_id": base.run_id})
    assert tiny.fingerprint() != base.fingerprint()
