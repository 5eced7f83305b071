"""`p2pdiloco prepare` and the token loader: text in every input format becomes shards that decode
back to it, a killed or interrupted preparation resumes to the same manifest, bad inputs are one
line and exit 2, the loader reads the windows the shards hold and never a corrupted shard, and a
peer trains on a prepared directory end to end. Small real files, real worker processes."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from p2pdiloco.config import Config, ConfigError
from p2pdiloco.data import load_data
from p2pdiloco.data.corpus import ByteData
from p2pdiloco.data.loader import TokenData
from p2pdiloco.data.manifest import file_sha256, read_manifest
from p2pdiloco.data.prepare import prepare
from p2pdiloco.data.tokenizer import load_tokenizer
from tests.conftest import ROOT, TINY, group_left

pytestmark = pytest.mark.timeout(180)

BYTES_EOT = 256
SYLLABLES = ["ka", "lo", "mi", "ren", "tha", "vos", "qui", "ed", "an", "tor", "sel", "ph", "ú", "ö", "ß"]


def pseudo_text(rng: random.Random, lines: int, syllables=SYLLABLES) -> str:
    """Lines of made-up words, sentence punctuation and a few non-ASCII letters."""
    out = []
    for _ in range(lines):
        words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(4, 14))]
        out.append(" ".join(words) + rng.choice([".", ",", "!", "?", ";"]))
    return "\n".join(out) + "\n"


def tokens_of(manifest, shard) -> np.ndarray:
    return np.fromfile(manifest.root / shard.file, dtype=manifest.dtype)


def split_at(ids: np.ndarray, eot: int) -> tuple[list[np.ndarray], np.ndarray]:
    """(the EOT-terminated runs, what follows the last EOT)."""
    cuts = np.flatnonzero(ids == eot)
    runs, start = [], 0
    for c in cuts:
        runs.append(ids[start:c])
        start = c + 1
    return runs, ids[start:]


def bytes_text(ids: np.ndarray) -> str:
    assert ids.size == 0 or int(ids.max()) < 256, "an EOT inside a run"
    return bytes(ids.astype(np.uint8)).decode("utf-8")


def unit_texts(manifest, index: int, decode) -> tuple[str, list[str], bool]:
    """(train text of unit `index`, its held-out pieces, whether its train shard ends with an EOT)."""
    train = {s.file: s for s in manifest.train}[f"train-{index:05d}.bin"]
    ids = tokens_of(manifest, train)
    runs, tail = split_at(ids, manifest.eot_id)
    assert len(runs) <= 1 and (not runs or tail.size == 0), "one document per unit: at most one EOT, at its end"
    text = decode(runs[0] if runs else tail)
    val = {s.file: s for s in manifest.val}.get(f"val-{index:05d}.bin")
    pieces = []
    if val is not None:
        runs, tail = split_at(tokens_of(manifest, val), manifest.eot_id)
        assert tail.size == 0, "every held-out piece ends with an EOT"
        pieces = [decode(r) for r in runs]
    return text, pieces, bool(ids.size) and int(ids[-1]) == manifest.eot_id


def assert_split_of(doc: str, train_text: str, pieces: list[str]) -> None:
    """doc is train_text with the held-out pieces cut out at line starts, in order."""
    rebuilt, at = [], 0
    for piece in pieces:
        assert piece.endswith("\n") or at + len(piece) == len(doc), piece[-20:]
        found = doc.find(piece, at)
        assert found >= 0, f"held-out piece not in its document: {piece[:40]!r}"
        assert found == 0 or doc[found - 1] == "\n", "a held-out piece starts mid-line"
        rebuilt.append(doc[at:found])
        at = found + len(piece)
    rebuilt.append(doc[at:])
    assert "".join(rebuilt) == train_text
    assert len(train_text) + sum(map(len, pieces)) == len(doc)


# --- shared inputs ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bpe_inputs(tmp_path_factory) -> tuple[Path, list[str]]:
    """~180 KB of pseudo-text in four files (one document each)."""
    root = tmp_path_factory.mktemp("bpe-in")
    rng = random.Random(7)
    docs = [pseudo_text(rng, 700) for _ in range(4)]
    for i, doc in enumerate(docs):
        (root / f"doc{i}.txt").write_text(doc)
    return root, docs


@pytest.fixture(scope="module")
def bpe_dir(bpe_inputs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bpe-out") / "tokens"
    prepare([str(bpe_inputs[0])], out, train_vocab=600, eval_fraction=0.05, workers=1)
    return out


# --- 1. text files, bytes -----------------------------------------------------------------------

def test_text_directory_bytes_round_trip(tmp_path):
    """Every byte of a directory of text files lands in exactly one split, documents end with EOT 256."""
    src = tmp_path / "in"
    (src / "sub").mkdir(parents=True)
    rng = random.Random(1)
    names = ["a.txt", "b.md", "sub/c.txt"]
    docs = [pseudo_text(rng, 230) for _ in names]
    for name, doc in zip(names, docs):
        (src / name).write_text(doc)
    (src / "notes.csv").write_text("not,an,input\n")
    m = prepare([str(src)], tmp_path / "out", tokenizer="bytes", eval_fraction=0.1, workers=1)

    assert (m.vocab_size, m.eot_id, m.dtype) == (257, BYTES_EOT, np.uint16)
    assert [s.file for s in m.train] == ["train-00000.bin", "train-00001.bin", "train-00002.bin"]
    assert m.val, "a tenth of ~40 KB in 256-byte pieces holds some out"
    for shard in m.train + m.val:
        assert file_sha256(m.root / shard.file) == shard.sha256
        ids = tokens_of(m, shard)
        assert (len(ids), int(ids.max())) == (shard.tokens, shard.max_id)
    total_bytes = sum(len(d.encode()) for d in docs)
    assert sum(s.text_bytes for s in m.train + m.val) == total_bytes
    ends = 0
    for i, doc in enumerate(docs):
        train_text, pieces, ends_with_eot = unit_texts(m, i, bytes_text)
        assert_split_of(doc, train_text, pieces)
        ends += ends_with_eot
    assert ends == len(docs), "every document ends with an EOT in the train stream, held-out last piece or not"
    eots = sum(int((tokens_of(m, s) == BYTES_EOT).sum()) for s in m.train + m.val)
    assert sum(s.tokens for s in m.train + m.val) == total_bytes + eots


# --- 2. a trained BPE ---------------------------------------------------------------------------

def test_trained_bpe_decodes_and_is_reproducible(bpe_inputs, bpe_dir, tmp_path):
    """A trained BPE is saved with its shards, decodes them to the input, and a re-run changes nothing."""
    src, docs = bpe_inputs
    m = read_manifest(bpe_dir)
    assert m.vocab_size == 600 and m.eot_id == 0 and m.raw["tokenizer"]["kind"] == "hf"
    tok = load_tokenizer(str(bpe_dir / "tokenizer.json"))
    assert (tok.vocab_size, tok.eot_id) == (600, 0)
    assert file_sha256(bpe_dir / "tokenizer.json") == m.raw["tokenizer"]["sha256"]
    for shard in m.train + m.val:
        ids = tokens_of(m, shard)
        assert int(ids.max()) == shard.max_id < m.vocab_size
    assert max(s.max_id for s in m.train) > 300, "the BPE merged: ids well past the byte alphabet"
    assert sum(s.text_bytes for s in m.train) > 2 * sum(s.tokens for s in m.train)
    for i, doc in enumerate(docs):
        train_text, pieces, _ = unit_texts(m, i, tok.decode)
        assert_split_of(doc, train_text, pieces)

    # the same text as bytes holds out the same pieces: the split does not depend on the tokenizer
    as_bytes = prepare([str(src)], tmp_path / "bytes", tokenizer="bytes", eval_fraction=0.05, workers=1)
    for i in range(len(docs)):
        assert unit_texts(as_bytes, i, bytes_text)[1] == unit_texts(m, i, tok.decode)[1]

    # a finished directory is kept as is
    stamps = {p.name: p.stat().st_mtime_ns for p in bpe_dir.iterdir()}
    said = []
    again = prepare([str(src)], bpe_dir, train_vocab=600, eval_fraction=0.05, workers=1, progress=said.append)
    assert again.digest == m.digest
    assert {p.name: p.stat().st_mtime_ns for p in bpe_dir.iterdir()} == stamps
    assert any("already prepared" in line for line in said), said

    # the same text into another directory: the same tokenizer, the same shards, the same held-out tokens
    other = prepare([str(src)], tmp_path / "again", train_vocab=600, eval_fraction=0.05, workers=1)
    assert other.digest == m.digest
    for a, b in zip(m.val, other.val, strict=True):
        assert (bpe_dir / a.file).read_bytes() == (other.root / b.file).read_bytes()


# --- 3. JSONL, parquet, a saved dataset ---------------------------------------------------------

def documents_in(m) -> list[str]:
    out = []
    for shard in m.train + m.val:
        runs, tail = split_at(tokens_of(m, shard), m.eot_id)
        assert tail.size == 0, f"{shard.file} does not end with an EOT"
        out.extend(bytes_text(r) for r in runs)
    return out


def test_jsonl_parquet_and_dataset_inputs(tmp_path):
    """JSONL (--text-key body), parquet row groups and a save_to_disk dataset: one EOT per document."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(3)
    docs = [f"doc {i}: " + pseudo_text(rng, rng.randint(1, 4)).strip() for i in range(300)]
    jsonl = tmp_path / "docs.jsonl"
    lines = [json.dumps({"id": i, "body": d}) for i, d in enumerate(docs)]
    lines.insert(150, "")  # a blank line is no document
    jsonl.write_text("\n".join(lines) + "\n")
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"n": list(range(len(docs))), "body": docs}), parquet, row_group_size=7)
    assert pq.ParquetFile(parquet).metadata.num_row_groups == 43
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"body": docs}).save_to_disk(str(saved))
    splits = tmp_path / "splits"  # a DatasetDict: its train split only, never its test split
    test_split = datasets.Dataset.from_dict({"body": ["held elsewhere"] * 5})
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": docs}), "test": test_split}).save_to_disk(
        str(splits))

    for name, path in [("jsonl", jsonl), ("parquet", parquet), ("dataset", saved), ("datasetdict", splits)]:
        m = prepare([str(path)], tmp_path / name, tokenizer="bytes", text_key="body", shard_mb=0.01,
                    eval_fraction=0.05, workers=1)
        assert len(m.train) > 1, f"{name}: cut into several units"
        assert m.val, name
        found = documents_in(m)
        eots = sum(int((tokens_of(m, s) == BYTES_EOT).sum()) for s in m.train + m.val)
        assert eots == len(found) == len(docs), name
        assert sorted(found) == sorted(docs), name


# --- 4. a given tokenizer -----------------------------------------------------------------------

def test_gpt2_vocabulary_offline(tmp_path):
    """--tokenizer gpt2: GPT-2's own ids from the files a registry package ships, no download."""
    tok = load_tokenizer("gpt2")
    assert tok.vocab_size == 50257 and tok.eot_id == 50256
    assert tok.encode_batch(["Hello world"])[0].tolist() == [15496, 995]
    (tmp_path / "a.txt").write_text("Hello world\n" * 2000)
    m = prepare([str(tmp_path / "a.txt")], tmp_path / "out", tokenizer="gpt2", eval_fraction=0.2, workers=1)
    assert m.raw["dtype"] == "uint16" and m.vocab_size == 50257
    assert tokens_of(m, m.train[0])[:2].tolist() == [15496, 995]


def test_tokenizer_json_and_transformers_directory(bpe_inputs, bpe_dir, tmp_path):
    """--tokenizer with a tokenizer.json or a transformers directory of the same BPE writes the same shards."""
    import transformers
    from tokenizers import Tokenizer as HFTok

    src, _ = bpe_inputs
    trained = read_manifest(bpe_dir)
    hf_dir = tmp_path / "hf-tok"
    transformers.PreTrainedTokenizerFast(tokenizer_object=HFTok.from_file(str(bpe_dir / "tokenizer.json")),
                                         eos_token="<|endoftext|>").save_pretrained(str(hf_dir))
    assert json.loads((hf_dir / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"
    for name, spec in [("json", bpe_dir / "tokenizer.json"), ("dir", hf_dir)]:
        m = prepare([str(src)], tmp_path / name, tokenizer=str(spec), eval_fraction=0.05, workers=1)
        assert (m.vocab_size, m.eot_id) == (600, 0), name
        assert [(s.file, s.sha256) for s in m.train] == [(s.file, s.sha256) for s in trained.train], name
        assert [(s.file, s.sha256) for s in m.val] == [(s.file, s.sha256) for s in trained.val], name
        assert (m.root / "tokenizer.json").is_file(), "the tokenizer travels with the shards"


# --- 5. kill, interrupt, resume -----------------------------------------------------------------

def journal_lines(out: Path) -> list[str]:
    try:
        return (out / ".prepare.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []


def test_killed_and_interrupted_prepare_resume_to_the_same_manifest(tmp_path):
    """SIGKILL or Ctrl-C mid-way, then a re-run: the same manifest as one uninterrupted run."""
    src = tmp_path / "big.txt"
    # ~2.5 MB: ~100 units of 25 KB, so that a run is still going when the test (on 2 busy cores)
    # sees its first records and signals it (CI saw a run of ~100 units finish first)
    src.write_text(pseudo_text(random.Random(11), 40000))
    units = math.ceil(src.stat().st_size / 25000)
    # 1% held out: pieces of ~1.6 KB, ~15 per unit, so that every unit keeps train text
    opts = dict(tokenizer="bytes", shard_mb=0.025, eval_fraction=0.01, workers=1)
    argv = [str(src), "--tokenizer", "bytes", "--shard-mb", "0.025", "--eval-fraction", "0.01", "--workers", "1",
            "--quiet"]
    killed, stopped = tmp_path / "killed", tmp_path / "stopped"
    # Ctrl-C's default action in the children, as from a terminal: a test run started in the
    # background (nohup, `cmd &`, as CI may be) inherits SIGINT ignored, and Python keeps it so
    procs = {out: subprocess.Popen([sys.executable, "-m", "p2pdiloco", "prepare", *argv, "--out", str(out)],
                                   stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True,
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
             for out in (killed, stopped)}
    try:
        signals = {killed: signal.SIGKILL, stopped: signal.SIGINT}
        deadline = time.monotonic() + 90
        while signals and time.monotonic() < deadline:
            for out in list(signals):
                if len(journal_lines(out)) >= 3:  # the identity and two finished units
                    assert procs[out].poll() is None, f"{out.name}: finished before it could be stopped"
                    # SIGKILL to the group (a killed machine takes the workers along); SIGINT to the
                    # main process, which stops its workers and says how to finish
                    sig = signals.pop(out)
                    (os.killpg if sig == signal.SIGKILL else os.kill)(procs[out].pid, sig)
            time.sleep(0.002)
        assert not signals, f"no journal records in time: {list(signals)}"
        assert procs[killed].wait(timeout=30) == -signal.SIGKILL
        assert group_left(procs[killed].pid) == []
        _, err = procs[stopped].communicate(timeout=60)
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert procs[stopped].returncode == 130, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "run the same command again" in lines[0], err
    assert group_left(procs[stopped].pid) == []
    whole = prepare([str(src)], tmp_path / "whole", **opts)  # after: the CLI starts fast enough to finish first
    assert len(whole.train) == units > 80

    for out in (killed, stopped):
        assert not (out / "manifest.json").exists(), out.name
    # the killed run: shards the journal names are kept, any other is redone, even a bogus one
    records = []
    for line in journal_lines(killed)[1:]:
        try:
            records.append(json.loads(line))
        except ValueError:
            break
    journaled = {r["index"] for r in records}
    assert len(journaled) >= 2
    first_unjournaled = min(set(range(units)) - journaled)
    (killed / f"train-{first_unjournaled:05d}.bin").write_bytes(b"\xff" * 999)
    with open(killed / ".prepare.jsonl", "a") as f:
        f.write('{"index": %d, "train": {"fi' % (units - 1))  # a record cut by the kill
    said = []
    resumed = prepare([str(src)], killed, progress=said.append, **opts)
    assert any(f"resuming in {killed}: {len(journaled)} of {units} shards" in line for line in said), said
    assert resumed.digest == whole.digest
    assert TokenData(resumed, block_size=32, progress=said.append).bad == []
    assert prepare([str(src)], stopped, **opts).digest == whole.digest
    for out in (killed, stopped):
        names = {p.name for p in out.iterdir()}
        assert names == {"manifest.json"} | {s.file for s in whole.train + whole.val}, out.name


# --- 6. bad inputs ------------------------------------------------------------------------------

# Each case is `python -m p2pdiloco ARGV` (runpy runs p2pdiloco/__main__.py, exactly as -m does) in
# its own process, forked from one interpreter that paid p2pdiloco's imports (torch, hivemind:
# seconds each on two shared cores) once. A case with `drop` first loses the capabilities that let
# root read any file, so that a chmod 000 file is unreadable when the suite runs as root too.
CLI_CASES = r'''
import ctypes, json, os, runpy, sys, traceback
import p2pdiloco.cli, p2pdiloco.data.prepare, p2pdiloco.peer  # noqa: F401

def drop_dac():
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
    libc = ctypes.CDLL(None, use_errno=True)
    header, data = Header(0x20080522, 0), (Data * 2)()
    assert libc.capget(ctypes.byref(header), data) == 0, ctypes.get_errno()
    keep = ~0b110 & 0xFFFFFFFF  # CAP_DAC_OVERRIDE (1), CAP_DAC_READ_SEARCH (2)
    data[0].effective &= keep
    data[0].permitted &= keep
    assert libc.capset(ctypes.byref(header), data) == 0, ctypes.get_errno()

results = []
for i, (argv, drop) in enumerate(json.loads(sys.argv[1])):
    err_path = os.path.join(sys.argv[2], f"{i}.err")
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
        code = 1
        try:
            if drop:
                drop_dac()
            sys.argv = ["p2pdiloco", *argv]
            runpy.run_module("p2pdiloco", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    results.append([os.waitstatus_to_exitcode(status), open(err_path).read()])
print(json.dumps(results))
'''


def test_bad_inputs_are_one_line_exit_2(tmp_path):
    """Missing, empty, keyless, unreadable inputs, bad tokenizer flags and bad manifests: one line, exit 2."""
    inp = tmp_path / "in"
    (inp / "nothing").mkdir(parents=True)
    (inp / "nothing" / "notes.csv").write_text("a,b\n")
    (inp / "empty.txt").write_text("")
    (inp / "keyless.jsonl").write_text('{"text": "one"}\n{"body": "two"}\n')
    (inp / "ok.txt").write_text(pseudo_text(random.Random(5), 200))
    (inp / "secret.txt").write_text("hidden\n")
    (inp / "secret.txt").chmod(0)
    (inp / "dangling.txt").symlink_to(tmp_path / "gone.txt")
    good = prepare([str(inp / "ok.txt")], tmp_path / "good", tokenizer="bytes", eval_fraction=0.1, workers=1)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "manifest.json").write_text('{"format": "webdataset", "version": 1}\n')
    unfinished = tmp_path / "unfinished"  # shards whose manifest was never written
    unfinished.mkdir()
    for shard in good.train:
        (unfinished / shard.file).write_bytes((good.root / shard.file).read_bytes())
    small_vocab = tmp_path / "small-vocab"
    small_vocab.mkdir()
    for shard in good.train + good.val:
        (small_vocab / shard.file).write_bytes((good.root / shard.file).read_bytes())
    (small_vocab / "manifest.json").write_text(json.dumps({**good.raw, "vocab_size": 200}))

    out = str(tmp_path / "out")
    prep = ["prepare", "--out", out]
    cases = [
        (prep + [str(inp / "missing.txt"), "--tokenizer", "bytes"], False, "input", "missing.txt does not exist"),
        (prep + [str(inp / "empty.txt"), "--tokenizer", "bytes"], False, "empty.txt", "hold no text"),
        (prep + [str(inp / "nothing"), "--tokenizer", "bytes"], False, "no inputs found under"),
        (prep + [str(inp / "keyless.jsonl"), "--tokenizer", "bytes"], False, "keyless.jsonl: line 2", "'text'"),
        (prep + [str(inp / "secret.txt"), "--tokenizer", "bytes"], True, "cannot read", "Permission denied"),
        (prep + [str(inp / "dangling.txt"), "--tokenizer", "bytes"], False, "dangling.txt does not exist"),
        (prep + [str(inp / "ok.txt"), "--tokenizer", "bytes", "--train-tokenizer", "--vocab-size", "600"], False,
         "--train-tokenizer", "not allowed with"),
        (prep + [str(inp / "ok.txt")], False, "one of the arguments --tokenizer --train-tokenizer is required"),
        (prep + [str(inp / "ok.txt"), "--train-tokenizer"], False, "--train-tokenizer --vocab-size N"),
        (prep + [str(inp / "ok.txt"), "--tokenizer", str(tmp_path / "no-tokenizer.json")], False,
         "no-tokenizer.json does not exist"),
        (["join", "--config", TINY, "--data", str(unfinished)], False, "no .txt files under", "unfinished"),
        (["join", "--config", TINY, "--data", str(foreign)], False, "not a p2pdiloco token manifest",
         "'webdataset'"),
        (["join", "--config", TINY, "--data", str(small_vocab)], False, "token id 256",
         "vocabulary size 200"),
    ]
    errs = tmp_path / "stderr"
    errs.mkdir()
    proc = subprocess.run([sys.executable, "-c", CLI_CASES, json.dumps([[c[0], c[1]] for c in cases]), str(errs)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout)
    for (argv, _, *fragments), (code, err) in zip(cases, results, strict=True):
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1, (argv, code, err)
        assert lines[0].startswith("p2pdiloco: error: "), (argv, err)
        for fragment in fragments:
            assert fragment in lines[0], (argv, lines[0])
    assert not Path(out, "manifest.json").exists()


# --- 7. the loader ------------------------------------------------------------------------------

def test_loader_windows_corrupt_shard_and_eval(tmp_path):
    """Windows are the shard's slices; a corrupted shard is reported once and never trained on."""
    src = tmp_path / "in"
    src.mkdir()
    alphabets = ["ab", "cd", "ef"]  # each document its own letters: a window shows which shard it came from
    rng = random.Random(2)
    for i, letters in enumerate(alphabets):
        (src / f"{i}.txt").write_text(pseudo_text(rng, 300, syllables=list(letters)))
    m = prepare([str(src)], tmp_path / "out", tokenizer="bytes", eval_fraction=0.1, workers=1)
    bs = 32

    data = TokenData(m, block_size=bs)
    assert data.bad == [] and data.vocab_size == 257
    assert data.train_windows == sum((s.tokens - 1) // bs for s in m.train)
    for shard in m.train + m.val:
        ids = tokens_of(m, shard).astype(np.int64)
        last = (shard.tokens - 1) // bs - 1
        for k in (0, 1, last):
            x, y = data.read_windows([(shard, k)])
            assert torch.equal(x[0], torch.from_numpy(ids[k * bs:k * bs + bs])), (shard.file, k)
            assert torch.equal(y[0], torch.from_numpy(ids[k * bs + 1:k * bs + bs + 1])), (shard.file, k)
    assert math.isclose(data.bits_per_byte(math.log(2)),
                        sum(s.tokens for s in m.val) / sum(s.text_bytes for s in m.val))

    evals = data.eval_batches(8, 3)
    again = TokenData(m, block_size=bs).eval_batches(8, 3)
    val_bytes = [tokens_of(m, s).tobytes() for s in m.val]
    for (x, y), (x2, y2) in zip(evals, again, strict=True):
        assert x.shape == (8, bs) and torch.equal(x, x2) and torch.equal(y, y2)
        for row in torch.cat([x, y[:, -1:]], dim=1):
            window = row.numpy().astype(np.uint16).tobytes()
            assert any(window in vb for vb in val_bytes), "an eval window that is no held-out slice"

    victim = m.train[1]
    raw = bytearray((m.root / victim.file).read_bytes())
    raw[len(raw) // 2] ^= 0x01
    (m.root / victim.file).write_bytes(bytes(raw))
    said = []
    data = TokenData(m, block_size=bs, progress=said.append)
    assert data.bad == [victim.file]
    assert len(said) == 1 and victim.file in said[0] and "sha256" in said[0], said
    g = torch.Generator().manual_seed(0)
    seen = np.zeros(258, dtype=bool)
    for _ in range(200):
        x, y = data.train_batch(8, g)
        assert x.shape == (8, bs) and x.dtype == torch.int64
        seen[x.flatten().numpy()] = True
        seen[y.flatten().numpy()] = True
    assert not seen[[ord("c"), ord("d")]].any(), "a window of the corrupted shard was trained on"
    assert seen[[ord("a"), ord("b"), ord("e"), ord("f")]].all(), "both whole shards are read"
    assert len(said) == 1, "reported once"


# --- 8. the config ------------------------------------------------------------------------------

def test_config_takes_vocab_and_digest_from_the_manifest(tmp_path):
    """vocab_size comes from the manifest, a smaller one is refused, the shards' digest is in the fingerprint."""
    rng = random.Random(4)
    texts = [tmp_path / "a.txt", tmp_path / "b.txt"]
    for path in texts:
        path.write_text(pseudo_text(rng, 250))
    dirs = {}
    for name, text in [("a", texts[0]), ("a-again", texts[0]), ("b", texts[1])]:
        dirs[name] = str(tmp_path / name)
        prepare([str(text)], dirs[name], tokenizer="bytes", eval_fraction=0.1, workers=1)

    cfg = Config(data=dirs["a"])
    assert cfg.vocab_size == 257
    assert Config(data=dirs["a"], vocab_size=300).vocab_size == 300
    with pytest.raises(ConfigError, match="smaller than the data's vocabulary"):
        Config(data=dirs["a"], vocab_size=256)
    assert Config(data=str(texts[0])).vocab_size == 256
    assert cfg.fingerprint() == Config(data=dirs["a-again"]).fingerprint()
    assert cfg.fingerprint() != Config(data=dirs["b"]).fingerprint()
    assert isinstance(load_data(cfg), TokenData)
    assert isinstance(load_data(Config(data=str(texts[0]))), ByteData)


# --- 9. end to end ------------------------------------------------------------------------------

def test_join_trains_on_a_prepared_directory(bpe_dir, tmp_path):
    """A lone peer trains on BPE shards: exit 0, a finite held-out loss and bits per byte, the data's vocab."""
    log_dir = tmp_path / "log"
    proc = subprocess.run([sys.executable, "-m", "p2pdiloco", "join", "--config", TINY, "--data", str(bpe_dir),
                           "--max-inner-steps", "40", "--inner-steps", "20", "--log-dir", str(log_dir), "--quiet"],
                          capture_output=True, text=True, timeout=150, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    m = read_manifest(bpe_dir)
    assert json.loads((log_dir / "config.json").read_text())["vocab_size"] == m.vocab_size == 600
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in records if r["event"] == "final"]
    assert len(final) == 1, records[-3:]
    final = final[0]
    assert final["inner_step"] == 40 and final["tokens"] == 40 * 16 * 64
    assert math.isfinite(final["eval_loss"]) and math.isfinite(final["eval_bpb"]) and final["data_s"] >= 0
    assert math.isclose(final["eval_bpb"], final["eval_loss"] / math.log(2) / m.bytes_per_token(), rel_tol=1e-4)
