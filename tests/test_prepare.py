"""`p2pdiloco prepare` and the shard loader: every input kind and tokenizer, shards that decode
back to the input, a re-run after SIGKILL that finishes the same manifest, the held-out split, bad
input as one line with exit 2, and a corrupted shard that is never trained on."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from p2pdiloco.config import Config, ConfigError
from p2pdiloco.data.loader import TokenData
from p2pdiloco.data.manifest import ManifestError, read_manifest
from p2pdiloco.data.prepare import JOURNAL, prepare
from p2pdiloco.data.tokenizer import load_tokenizer
from tests.conftest import TINY

pytestmark = pytest.mark.timeout(180)
QUIET = dict(progress=lambda _: None, workers=1)
WORDS = ("swarm peer anchor round shard token window epoch claim lease cursor model train volunteer "
         "gradient outer inner average group king queen fool ghost sea crown").split()


def docs(n, seed=0, words=(20, 120)):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))) + "." for _ in range(n)]


def tokens_of(root, split):
    m = read_manifest(root)
    return [np.fromfile(root / s.file, dtype=m.dtype) for s in (m.train if split == "train" else m.val)]


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "p2pdiloco", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_text_files_as_bytes_decode_back(tmp_path):
    """Every byte of every file lands in exactly one split; each file ends with the EOT id; the
    manifest's sha256 and counts are the files'."""
    src = tmp_path / "src"
    src.mkdir()
    texts = ["\n".join(docs(40, seed=i)) + "\n" for i in range(5)]
    for i, t in enumerate(texts):
        (src / f"doc{i}.txt").write_text(t)
    m = prepare([str(src)], tmp_path / "out", tokenizer="bytes", shard_mb=0.004, eval_fraction=0.1, **QUIET)
    assert m.vocab_size == 257 and m.eot_id == 256 and m.raw["dtype"] == "uint16"
    train, val = tokens_of(tmp_path / "out", "train"), tokens_of(tmp_path / "out", "val")
    assert len(train) > 5 and sum(len(v) for v in val) > 0
    for shard, arr in zip(m.train + m.val, train + val):
        assert shard.tokens == len(arr) and shard.max_id == int(arr.max())
    train_bytes = bytes(int(t) for arr in train for t in arr if t != 256)
    val_bytes = bytes(int(t) for arr in val for t in arr if t != 256)
    assert len(train_bytes) + len(val_bytes) == sum(len(t.encode()) for t in texts)
    assert sum(int((arr == 256).sum()) for arr in train) == len(texts)  # one EOT per document
    for line in val_bytes.decode().splitlines():
        assert any(line in t for t in texts)


def test_trained_bpe_rerun_and_held_out_split(tmp_path):
    """A trained BPE is saved with the shards; a re-run is a no-op; the same text prepared again
    holds out the same pieces."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(docs(3000, seed=1)))
    kw = dict(train_vocab=600, shard_mb=0.05, eval_fraction=0.02, **QUIET)
    m = prepare([str(corpus)], tmp_path / "a", **kw)
    assert (tmp_path / "a" / "tokenizer.json").is_file() and not (tmp_path / "a" / JOURNAL).exists()
    assert max(s.max_id for s in m.train) < m.vocab_size <= 600 and len(m.train) >= 4
    tok = load_tokenizer(str(tmp_path / "a" / "tokenizer.json"))
    text = tok.decode(tokens_of(tmp_path / "a", "train")[0][:200])
    assert all(w.strip(".") in WORDS for w in text.split()[1:-1])
    assert prepare([str(corpus)], tmp_path / "a", **kw).digest == m.digest
    again = prepare([str(corpus)], tmp_path / "b", **kw)
    assert again.digest == m.digest  # tokenizer, shards and held-out split alike
    assert 0.005 < sum(s.text_bytes for s in m.val) / corpus.stat().st_size < 0.05


def test_jsonl_parquet_and_saved_dataset(tmp_path):
    """JSON lines (--text-key), parquet row groups and a datasets dataset saved on disk: one EOT
    per document in each."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = docs(200, seed=2)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": r, "id": i}) + "\n" for i, r in enumerate(rows)))
    pq.write_table(pa.table({"text": rows}), tmp_path / "b.parquet", row_group_size=16)
    datasets.Dataset.from_dict({"text": rows}).save_to_disk(str(tmp_path / "c"))
    for inp, key in (("a.jsonl", "body"), ("b.parquet", "text"), ("c", "text")):
        out = tmp_path / f"out-{inp}"
        prepare([str(tmp_path / inp)], out, tokenizer="bytes", text_key=key, shard_mb=0.005, eval_fraction=0.05,
                **QUIET)
        arrays = tokens_of(out, "train") + tokens_of(out, "val")
        assert sum(int((a == 256).sum()) for a in arrays) == len(rows), inp
        assert len(tokens_of(out, "train")) >= 2, inp


def test_tokenizer_json_and_transformers_directory_agree(tmp_path):
    """--tokenizer with a tokenizer.json and with a transformers directory holding it: the same shards."""
    import transformers

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(docs(800, seed=3)))
    prepare([str(corpus)], tmp_path / "trained", train_vocab=512, shard_mb=0.05, **QUIET)
    tok = load_tokenizer(str(tmp_path / "trained" / "tokenizer.json"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok.tok, eos_token="<|endoftext|>").save_pretrained(
        tmp_path / "hfdir")
    a = prepare([str(corpus)], tmp_path / "a", tokenizer=str(tmp_path / "trained" / "tokenizer.json"),
                shard_mb=0.05, **QUIET)
    b = prepare([str(corpus)], tmp_path / "b", tokenizer=str(tmp_path / "hfdir"), shard_mb=0.05, **QUIET)
    assert [s.sha256 for s in a.train] == [s.sha256 for s in b.train] and a.eot_id == b.eot_id == 0


def test_sigkill_then_rerun_finishes_the_same_manifest(tmp_path):
    """prepare killed mid-way leaves no manifest and no shard it would read; the re-run skips the
    journaled shards and ends with the manifest of an uninterrupted run."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(docs(6000, seed=4)))
    args = [str(corpus), "--tokenizer", "bytes", "--shard-mb", "0.01", "--workers", "1", "--quiet"]
    proc = subprocess.Popen([sys.executable, "-m", "p2pdiloco", "prepare", *args, "--out", str(tmp_path / "k")],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    journal = tmp_path / "k" / JOURNAL
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if journal.exists() and len(journal.read_text().splitlines()) >= 4:
                break
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert not (tmp_path / "k" / "manifest.json").exists()
    done = len(journal.read_text().splitlines()) - 1
    assert done >= 3
    again = cli("prepare", *args[:-1], "--out", str(tmp_path / "k"))  # not --quiet: its status lines
    assert again.returncode == 0, again.stderr
    assert f"resuming in {tmp_path / 'k'}: {done} of" in again.stderr
    whole = prepare([str(corpus)], tmp_path / "whole", tokenizer="bytes", shard_mb=0.01, **QUIET)
    assert read_manifest(tmp_path / "k").digest == whole.digest
    assert not list((tmp_path / "k").glob(".*.tmp"))


def bad(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "nothing").mkdir()
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"other": 1}\n')
    (tmp_path / "dangling.txt").symlink_to(tmp_path / "gone.txt")
    return tmp_path


BAD = [
    (["{t}/missing.txt", "--tokenizer", "bytes"], "does not exist"),
    (["{t}/empty.txt", "--tokenizer", "bytes"], "hold no text"),
    (["{t}/nothing", "--tokenizer", "bytes"], "no inputs found"),
    (["{t}/bad.jsonl", "--tokenizer", "bytes"], "not a JSON object with a 'text' string"),
    (["{t}/dangling.txt", "--tokenizer", "bytes"], "does not exist"),
    (["{t}/bad.jsonl"], "one of the arguments --tokenizer --train-tokenizer is required"),
    (["{t}/bad.jsonl", "--tokenizer", "bytes", "--train-tokenizer"], "not allowed with argument"),
    (["{t}/bad.jsonl", "--tokenizer", "{t}/no-such-tokenizer.json"], "does not exist"),
    (["{t}/bad.jsonl", "--train-tokenizer", "--vocab-size", "100"], "at least 512"),
    (["{t}/bad.jsonl", "--tokenizer", "bytes", "--eval-fraction", "0.9"], "--eval-fraction"),
]


@pytest.mark.parametrize("args, fragment", BAD)
def test_bad_prepare_input_is_one_line_exit_2(tmp_path, args, fragment, capsys):
    """Each bad input or flag: exit 2, one line on stderr, no traceback (the CLI's parser and
    `prepare` in this process; the first two cases also through a real `p2pdiloco` process)."""
    from p2pdiloco.cli import build_parser
    from p2pdiloco.data import prepare as command

    bad(tmp_path)
    argv = ["prepare", *[a.format(t=tmp_path) for a in args], "--out", str(tmp_path / "out")]
    try:
        code = command.run(build_parser().parse_args(argv))
    except SystemExit as e:  # the parser's own errors
        code = e.code
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and fragment in lines[0], lines
    if args in (BAD[0][0], BAD[5][0]):
        proc = cli(*argv)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines() == lines, proc.stderr


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepared")
    (root / "corpus.txt").write_text("\n".join(docs(2000, seed=5)))
    prepare([str(root / "corpus.txt")], root / "tokens", tokenizer="bytes", shard_mb=0.03, eval_fraction=0.05,
            **QUIET)
    return root / "tokens"


def test_loader_windows_and_a_corrupted_shard(prepared, tmp_path):
    """Windows are the shard's slices; eval batches agree across loaders; a shard whose bytes
    changed is reported once by name and never read."""
    import shutil

    m = read_manifest(prepared)
    data = TokenData(m, block_size=32, progress=lambda _: None)
    shard = m.train[1]
    x, y = data.read_windows([(shard, 3)])
    raw = np.fromfile(prepared / shard.file, dtype=m.dtype)
    assert x[0].tolist() == raw[96:128].tolist() and y[0].tolist() == raw[97:129].tolist()
    again = TokenData(m, block_size=32, progress=lambda _: None)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(data.eval_batches(4, 3), again.eval_batches(4, 3)))
    assert data.bits_per_byte(1.0) == pytest.approx(1 / np.log(2) / m.bytes_per_token())

    copy = tmp_path / "tokens"
    shutil.copytree(prepared, copy)
    with open(copy / shard.file, "r+b") as f:
        f.seek(10)
        f.write(b"\x07\x00")
    said = []
    broken = TokenData(read_manifest(copy), block_size=32, progress=said.append)
    assert broken.bad == [shard.file] and len(said) == 1 and shard.file in said[0] and "sha256" in said[0]
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(200):
        picks = torch.randint(0, broken.train_windows, (8,), generator=gen).tolist()
        seen |= {broken._window(broken._train_ends, broken.train, g)[0].file for g in picks}
    assert shard.file not in seen and len(seen) == len(m.train) - 1


def test_config_takes_vocab_and_fingerprint_from_the_manifest(prepared, tmp_path):
    """vocab_size comes from the manifest; a smaller one is refused; the manifest's hash is in the
    fingerprint (another preparation of other text gives another one); a foreign or out-of-range
    manifest is one line, exit 2."""
    cfg = Config.from_sources(TINY, {"data": str(prepared)})
    assert cfg.vocab_size == 257
    with pytest.raises(ConfigError, match="smaller than the data's vocabulary"):
        Config.from_sources(TINY, {"data": str(prepared), "vocab_size": 256})
    (tmp_path / "other.txt").write_text("\n".join(docs(2000, seed=6)))
    prepare([str(tmp_path / "other.txt")], tmp_path / "other", tokenizer="bytes", shard_mb=0.03, eval_fraction=0.05,
            **QUIET)
    assert Config.from_sources(TINY, {"data": str(tmp_path / "other")}).fingerprint() != cfg.fingerprint()
    assert Config.from_sources(TINY, {"data": str(prepared)}).fingerprint() == cfg.fingerprint()

    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "manifest.json").write_text('{"format": "something-else"}')
    proc = cli("join", "--config", TINY, "--data", str(tmp_path / "foreign"))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "not a p2pdiloco token manifest" in lines[0], proc.stderr
    raw = json.loads((prepared / "manifest.json").read_text())
    raw["vocab_size"] = 100
    (tmp_path / "foreign" / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ManifestError, match="not below the vocabulary size 100"):
        read_manifest(tmp_path / "foreign")
