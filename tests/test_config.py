"""Config: presets, overrides, validation and the fingerprint that keys the swarm."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2pdiloco.config import MODEL_KEYS, Config, ConfigError
from tests.conftest import make_corpus

ROOT = Path(__file__).parents[1]


def test_defaults_are_valid():
    cfg = Config()
    assert cfg.inner_steps == 50
    assert cfg.request_timeout < cfg.matchmaking_time
    assert cfg.host_maddrs == ["/ip4/0.0.0.0/tcp/0"]
    # list defaults are not shared between instances
    other = Config()
    other.initial_peers.append("/ip4/1.2.3.4/tcp/1")
    assert Config().initial_peers == []


def test_presets_load():
    tiny = Config.from_sources(ROOT / "peers" / "tiny-cpu.toml")
    assert tiny.run_id == "tiny"
    assert (tiny.n_layer, tiny.n_head, tiny.n_embd) == (2, 4, 64)
    assert tiny.host_maddrs == ["/ip4/127.0.0.1/tcp/0"]
    assert tiny.threads == 1
    assert isinstance(tiny.inner_lr, float) and tiny.inner_lr == pytest.approx(3e-3)

    small = Config.from_sources(str(ROOT / "peers" / "small-gpu.toml"))
    assert small.run_id == "small-gpu"
    assert (small.n_layer, small.n_head, small.n_embd, small.block_size) == (12, 12, 768, 512)
    assert small.fingerprint() != tiny.fingerprint()


def test_gpu_presets_train_on_the_builtin_bpe_without_preparing_it_to_read_a_config(monkeypatch, tmp_path):
    """small-gpu and volunteer name the built-in Shakespeare BPE: the config knows its vocabulary and
    digest (the fingerprint) before anything is prepared; a peer prepares it on first use and checks
    the digest (here on a stand-in corpus, offline: the digest differs, one line, nothing trained)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for preset in ("small-gpu", "volunteer"):
        cfg = Config.from_sources(ROOT / "peers" / f"{preset}.toml")
        assert cfg.data == "shakespeare-bpe" and cfg.vocab_size == 4096
    assert not (tmp_path / "cache").exists()
    (tmp_path / "cache" / "p2pdiloco").mkdir(parents=True)
    make_corpus(tmp_path / "cache" / "p2pdiloco" / "shakespeare.txt", size=100_000)
    from p2pdiloco.data import DataError, data_path

    with pytest.raises(DataError, match="does not hold the shakespeare-bpe this p2pdiloco expects"):
        data_path("shakespeare-bpe", progress=lambda _: None)
    assert (tmp_path / "cache" / "p2pdiloco" / "shakespeare-bpe" / "manifest.json").is_file()


def test_volunteer_preset_is_for_the_public_internet(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    vol = Config.from_sources(ROOT / "peers" / "volunteer.toml")
    tiny = Config.from_sources(ROOT / "peers" / "tiny-cpu.toml")
    assert vol.host_maddrs == ["/ip4/0.0.0.0/tcp/31337"]  # all interfaces, a port others can dial
    assert vol.use_relay and vol.use_auto_relay and not vol.client_mode and vol.reachability == "auto"
    assert vol.identity_path == str(tmp_path / ".p2pdiloco" / "identity.key")  # ~ expanded
    assert vol.checkpoint_dir.startswith(str(tmp_path))
    for key in ("matchmaking_time", "request_timeout", "allreduce_timeout", "next_chunk_timeout", "verdict_timeout",
                "state_timeout", "bootstrap_timeout"):
        assert getattr(vol, key) > getattr(tiny, key), key


def test_every_preset_key_is_commented():
    """Each key of each preset in peers/ carries a comment on its line or in the lines just above."""
    presets = sorted((ROOT / "peers").glob("*.toml"))
    assert {p.stem for p in presets} >= {"tiny-cpu", "small-gpu", "volunteer", "tiny-llama"}
    for preset in presets:
        lines = preset.read_text().splitlines()
        for i, line in enumerate(lines):
            if "=" in line and not line.lstrip().startswith("#"):
                above = lines[i - 1].lstrip() if i else ""
                assert "#" in line or above.startswith("#"), f"{preset.name}:{i + 1}: {line!r} has no comment"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "peer.toml"
    path.write_text(text)
    return path


def test_unknown_key_in_toml(tmp_path):
    path = _write(tmp_path, "[inner]\ninner_steps = 10\ninner_stepz = 20\n")
    with pytest.raises(ConfigError, match="inner_stepz"):
        Config.from_sources(path)


def test_unknown_override_key():
    with pytest.raises(ConfigError, match="no_such_key"):
        Config.from_sources(None, {"no_such_key": 1})


def test_bad_toml(tmp_path):
    path = _write(tmp_path, "inner_steps = = 3\n[oops\n")
    with pytest.raises(ConfigError):
        Config.from_sources(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        Config.from_sources(tmp_path / "nope.toml")


def test_nested_table_and_duplicate_key(tmp_path):
    with pytest.raises(ConfigError):
        Config.from_sources(_write(tmp_path, "[a.b]\nseed = 1\n"))
    with pytest.raises(ConfigError, match="seed"):
        Config.from_sources(_write(tmp_path, "[a]\nseed = 1\n[b]\nseed = 2\n"))


@pytest.mark.parametrize("overrides", [
    {"inner_steps": 0},
    {"inner_lr": -1e-3},
    {"outer_momentum": 1.0},
    {"request_timeout": 2.5, "matchmaking_time": 2.5},
    {"request_timeout": 3.0, "matchmaking_time": 2.5},
    {"n_embd": 65, "n_head": 4},
    {"compression": "int3"},
    {"initial_peers": ["not-a-maddr"]},
    {"initial_peers": "not-a-maddr"},
    {"run_id": "my.run"},
    {"inner_steps": "abc"},
    {"inner_steps": 2.5},
    {"outer_lr": float("nan")},
    {"outer_lr": "nan"},
    {"outer_lr": float("inf")},
    {"client_mode": "maybe"},
    {"host_maddrs": []},
    {"min_group_size": 5, "target_group_size": 4},
    {"device": "tpu"},
])
def test_invalid_values(overrides):
    with pytest.raises(ConfigError):
        Config.from_sources(None, overrides)


def test_invalid_value_in_file(tmp_path):
    with pytest.raises(ConfigError, match="outer_lr"):
        Config.from_sources(_write(tmp_path, "[outer]\nouter_lr = nan\n"))
    with pytest.raises(ConfigError, match="inner_steps"):
        Config.from_sources(_write(tmp_path, '[inner]\ninner_steps = "abc"\n'))


def test_invalid_values_direct_construction():
    for kw in ({"inner_steps": 0}, {"run_id": "a.b"}, {"compression": "int3"},
               {"initial_peers": ["not-a-maddr"]}, {"outer_momentum": 1.0}):
        with pytest.raises(ConfigError):
            Config(**kw)


def test_overrides_win_over_file(tmp_path):
    path = _write(tmp_path, '[run]\nrun_id = "file-run"\n[inner]\ninner_steps = 10\ninner_lr = 1e-3\n')
    cfg = Config.from_sources(path)
    assert (cfg.run_id, cfg.inner_steps, cfg.inner_lr) == ("file-run", 10, 1e-3)
    cfg = Config.from_sources(path, {"inner_steps": 20, "inner_lr": "2e-3"})
    assert cfg.inner_steps == 20 and isinstance(cfg.inner_steps, int)
    assert cfg.inner_lr == pytest.approx(2e-3) and isinstance(cfg.inner_lr, float)
    assert cfg.run_id == "file-run"
    # strings from the command line are coerced
    cfg = Config.from_sources(path, {"inner_steps": "30", "client_mode": "yes"})
    assert cfg.inner_steps == 30 and cfg.client_mode is True


def test_list_fields_accept_comma_separated_string():
    a, b = "/ip4/127.0.0.1/tcp/1234", "/ip4/10.0.0.2/tcp/5678"
    cfg = Config.from_sources(None, {"initial_peers": f"{a},{b}"})
    assert cfg.initial_peers == [a, b]
    cfg = Config.from_sources(None, {"initial_peers": ""})
    assert cfg.initial_peers == []
    cfg = Config.from_sources(None, {"host_maddrs": [a]})
    assert cfg.host_maddrs == [a]


def test_fingerprint_ignores_non_model_keys():
    base = Config()
    other = Config(inner_lr=1e-4, batch_size=3, outer_lr=0.3, inner_steps=7, seed=42)
    assert base.fingerprint() == other.fingerprint()
    assert base.dht_prefix == other.dht_prefix
    assert len(base.fingerprint()) == 12


def test_fingerprint_changes_with_model_or_run():
    base = Config()
    assert Config(n_layer=3).fingerprint() != base.fingerprint()
    assert Config(run_id="another").fingerprint() != base.fingerprint()
    assert Config(run_id="another").dht_prefix != base.dht_prefix
    changed = {"n_layer": 3, "n_head": 8, "n_embd": 128, "block_size": 32, "vocab_size": 300}
    assert set(changed) == set(MODEL_KEYS)
    for key, value in changed.items():
        assert Config(**{key: value}).fingerprint() != base.fingerprint(), key


def test_dht_prefix_has_no_dot():
    for cfg in (Config(), Config(run_id="a-b_c"), Config.from_sources(ROOT / "peers" / "tiny-cpu.toml")):
        assert "." not in cfg.dht_prefix
        assert cfg.run_id in cfg.dht_prefix
        assert cfg.fingerprint() in cfg.dht_prefix


def test_fingerprint_keys_the_wire_format():
    """fp16 and fp32 peers can average together; our low-bit codecs and the negative control cannot."""
    base = Config()
    assert Config(compression="none").fingerprint() == base.fingerprint()
    assert Config(compression="int8").fingerprint() != base.fingerprint()
    assert Config(compression="int4").fingerprint() != Config(compression="int8").fingerprint()
    assert Config(outer_apply="per_contribution").fingerprint() != base.fingerprint()


def test_benchmark_knobs_are_checked():
    for bad in ({"compression": "int2"}, {"outer_apply": "each"}, {"slowdown": 0.5},
                {"outer_apply": "per_contribution", "target_group_size": 32}):
        with pytest.raises(ConfigError):
            Config.from_sources(None, bad)
    assert Config.from_sources(None, {"sync_rounds": "true"}).sync_rounds is True


def test_gpt_fingerprints_are_pinned():
    """hf_config added a branch to fingerprint(); peers of the built-in GPT must still meet older peers."""
    assert Config().fingerprint() == "b5e83b63bc6b"
    assert Config.from_sources(ROOT / "peers" / "tiny-cpu.toml").fingerprint() == "9a72283f6db1"
    # the preset on bytes (its data before the built-in BPE), and on the built-in BPE (data/builtin.py)
    assert Config.from_sources(ROOT / "peers" / "small-gpu.toml", {"data": ""}).fingerprint() == "8d3cc7495696"
    assert Config.from_sources(ROOT / "peers" / "small-gpu.toml").fingerprint() == "d10e031b8e79"
    assert Config(compression="int8").fingerprint() == "23466204c2fd"


def test_hf_config_path_is_read_next_to_the_preset(tmp_path, monkeypatch):
    (tmp_path / "presets" / "hf").mkdir(parents=True)
    model = tmp_path / "presets" / "hf" / "m.json"
    model.write_text('{"model_type": "llama", "vocab_size": 256}')
    preset = _write(tmp_path / "presets", '[model]\nhf_config = "hf/m.json"\n')
    monkeypatch.chdir(tmp_path)
    assert Config.from_sources(preset).hf_config == str(model)
    # a flag's relative path is read from the cwd, and wins over the preset's
    (tmp_path / "flag.json").write_text('{"model_type": "llama", "vocab_size": 256}')
    assert Config.from_sources(preset, {"hf_config": "flag.json"}).hf_config == str(tmp_path / "flag.json")
    assert Config.from_sources(preset, {"hf_config": str(model)}).hf_config == str(model)
    assert Config.from_sources(preset, {"hf_config": ""}).hf_config == ""  # back to the built-in GPT
    assert Config.from_sources(None, {"hf_config": "presets/hf/m.json"}).hf_config == str(model)
    with pytest.raises(ConfigError, match="not found"):  # not next to the cwd's preset-relative guess
        Config.from_sources(None, {"hf_config": "hf/m.json"})


@pytest.mark.parametrize("text, match", [
    ("[1, 2]", "JSON object"),
    ('{"vocab_size": 256}', "model_type"),
    ('{"model_type": 3}', "model_type"),
    ("{oops", "bad JSON"),
    ('{"model_type": "llama", "vocab_size": 50257}', "vocab_size"),
    ('{"model_type": "llama", "max_position_embeddings": 16}', "max_position_embeddings"),
    ('{"model_type": "llama", "max_position_embeddings": "64"}', "max_position_embeddings"),
])
def test_hf_config_file_is_checked(tmp_path, text, match):
    path = tmp_path / "m.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match) as e:
        Config(hf_config=str(path))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="cannot read"):
        Config(hf_config=str(tmp_path))  # a directory
