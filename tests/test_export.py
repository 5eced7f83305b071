"""The model out again: `p2pdiloco export` writes a checkpoint's kept model as a transformers model
directory that `from_pretrained` loads with the same logits as ours, and `p2pdiloco sample`
prints continuations; bad input is one line, exit 2."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from p2pdiloco import checkpoint
from p2pdiloco.config import Config
from p2pdiloco.data.manifest import read_manifest
from p2pdiloco.data.prepare import prepare
from p2pdiloco.export import load_kept_model
from p2pdiloco.localswarm import LocalSwarm
from p2pdiloco.model import flat_params
from tests.conftest import ROOT, TINY, make_corpus

pytestmark = pytest.mark.timeout(240)


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "p2pdiloco", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A BPE-prepared corpus and the checkpoint of a peer that trained on it for 60 steps."""
    root = tmp_path_factory.mktemp("export")
    corpus = make_corpus(root / "corpus.txt", size=200_000, seed=5)
    prepare([str(corpus)], root / "tokens", train_vocab=600, shard_mb=0.05, eval_fraction=0.05, workers=1,
            progress=lambda _: None)
    flags = ["--config", TINY, "--data", str(root / "tokens"), "--checkpoint-dir", str(root / "ckpt")]
    proc = cli("join", *flags, "--max-inner-steps", "60", "--inner-steps", "30", "--quiet")
    assert proc.returncode == 0, proc.stderr
    return root, flags


def test_export_round_trip_gives_our_logits(trained, tmp_path):
    """transformers loads the exported GPT-2 and its tokenizer; logits equal ours within fp32 tolerance."""
    import transformers

    root, flags = trained
    proc = cli("export", *flags, "--out", str(tmp_path / "model"))
    assert proc.returncode == 0, proc.stderr
    assert "GPT2LMHeadModel; tokenizer included" in proc.stderr + proc.stdout
    assert (tmp_path / "model" / "model.safetensors").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model", local_files_only=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "model", local_files_only=True)
    vocab = read_manifest(root / "tokens").vocab_size  # BPE stops merging early on this tiny grammar
    assert tok.eos_token == "<|endoftext|>" and hf.config.vocab_size == vocab and len(tok) == vocab
    text = "the king speaks at dawn. a fool weeps in the hall."
    ids = torch.tensor([tok(text)["input_ids"]])
    assert tok.decode(ids[0]) == text  # the same tokenizer as the shards'
    cfg = Config.from_sources(TINY, {"data": str(root / "tokens"), "checkpoint_dir": str(root / "ckpt")})
    ours, _, _ = load_kept_model(cfg)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours.logits(ids), rtol=1e-5, atol=1e-5)
    # what is exported is the model the peer kept, its anchors' average (here, alone, it applied no outer step:
    # the average is its anchor), not its last anchor; an unusable average falls back to the anchor
    payload, _, _ = checkpoint.load_latest(cfg.checkpoint_dir, cfg)
    torch.testing.assert_close(flat_params(ours), payload["average"])
    for average, expected in ((payload["anchor"] * 0.5, payload["anchor"] * 0.5),
                              (torch.full_like(payload["anchor"], math.nan), payload["anchor"])):
        ckpt = tmp_path / f"ckpt-{len(list(tmp_path.iterdir()))}"
        checkpoint.save_checkpoint(ckpt, {**payload, "average": average}, outer_step=payload["outer_step"])
        kept, _, _ = load_kept_model(Config.from_sources(TINY, {"data": str(root / "tokens"),
                                                                "checkpoint_dir": str(ckpt)}))
        torch.testing.assert_close(flat_params(kept), expected)


def test_export_hf_config_model(tmp_path, corpus):
    """An hf_config model (tiny Llama) is exported as itself and loads with the same logits."""
    import transformers

    flags = ["--config", str(ROOT / "peers" / "tiny-llama.toml"), "--data", str(corpus), "--checkpoint-dir",
             str(tmp_path / "ckpt")]
    assert cli("join", *flags, "--max-inner-steps", "10", "--inner-steps", "5", "--quiet").returncode == 0
    proc = cli("export", *flags, "--out", str(tmp_path / "model"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "model" / "README.txt").read_text().startswith("Trained by p2pdiloco on bytes")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model", local_files_only=True).eval()
    cfg = Config.from_sources(flags[1], {"data": str(corpus), "checkpoint_dir": str(tmp_path / "ckpt")})
    ours, _, _ = load_kept_model(cfg)
    ids = torch.tensor([list(b"the king speaks")])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours.logits(ids), rtol=1e-5, atol=1e-5)


def test_sample_prints_continuations(trained):
    """`sample` prints --num-samples continuations that start with the prompt."""
    _, flags = trained
    proc = cli("sample", *flags, "--prompt", "the king", "--num-samples", "2", "--max-new-tokens", "20")
    assert proc.returncode == 0, proc.stderr
    samples = [s.strip() for s in proc.stdout.split("-" * 40) if s.strip()]
    assert samples[0].startswith("# ckpt-")
    bodies = [s.splitlines()[-1] if i == 0 else s for i, s in enumerate(samples)]
    assert len(bodies) == 2 and all(b.startswith("the king") and len(b) > len("the king") for b in bodies), samples


def test_sample_from_a_live_swarm(trained, tmp_path):
    """`sample --initial-peers` downloads the swarm's newest state from its live peers (as a client)
    and prints continuations from it; the peers train on."""
    root, _ = trained
    data = ["--data", str(root / "tokens")]
    with LocalSwarm(tmp_path, config=TINY, extra_args=[*data, "--inner-steps", "20"]) as swarm:
        swarm.start("a")
        swarm.start("b", join="a")
        swarm.wait_for(lambda: any(e["outer_step"] >= 1 for e in swarm.events("a", "outer")), timeout=90,
                       what="a round")
        proc = cli("sample", "--config", TINY, *data, "--initial-peers", swarm.maddr("a"), "--prompt", "the king",
                   "--num-samples", "2", "--max-new-tokens", "20")
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        header, *rest = [s.strip() for s in proc.stdout.split("-" * 40) if s.strip()]
        first, body = header.splitlines()[0], "\n".join(header.splitlines()[1:])
        assert first.startswith("# the live swarm (") and int(first.rsplit(" ", 1)[1]) >= 1, first
        assert all(b.startswith("the king") for b in [body, *rest]) and len(rest) == 1, proc.stdout
        steps = len(swarm.events("a", "inner"))
        swarm.wait_for(lambda: len(swarm.events("a", "inner")) > steps, timeout=30, what="a training on")


@pytest.mark.parametrize("extra, fragment", [
    (["--checkpoint-dir", "/nonexistent/ckpt"], "does not exist"),
    ([], "pass --checkpoint-dir"),
    (["--n-embd", "32"], "belongs to run"),  # the checkpoint of another model config
])
def test_bad_export_input_is_one_line_exit_2(trained, tmp_path, extra, fragment):
    """A missing or foreign checkpoint is one line on stderr and exit 2, for export and sample."""
    _, flags = trained
    if "--checkpoint-dir" in extra or not extra:
        flags = flags[:4]  # --config and --data only
    for command in (["export", "--out", str(tmp_path / "m")], ["sample", "--max-new-tokens", "2"]):
        proc = cli(*command, *flags, *extra)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and fragment in lines[0], proc.stderr
