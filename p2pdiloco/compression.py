"""Pseudo-gradient transport codecs: fp32, fp16 (hivemind's) and our own blockwise 8-bit and 4-bit.

hivemind 1.1.12's own 8-bit codecs decode to garbage under numpy 2 while the round reports
success (DESIGN.md), so the low-bit codecs are ours:

    blocks of `block_size` values; per block one fp32 scale s = max|x|;
    code q = round(x / s * L) with L = 127 (int8) or 7 (int4, two codes per byte);
    decode x' = q * s / L, so |x - x'| <= s / (2L) in every block.

Codes are decoded to fp32 and the reducer accumulates in fp32. With a low-bit codec a reducer
answers every member with the *average* itself, encoded once (not each member's own delta to
it, as hivemind does), so all members of a round hold bit-identical averages (see allreduce.py).

A block that holds a non-finite value gets a NaN scale, so it decodes to NaN and the receiving
reducer rejects the part rather than averaging a silently clamped value.

    >>> codec = make_codec("int4")
    >>> msg = codec.compress(x, CompressionInfo.from_tensor(x))     # a hivemind runtime_pb2.Tensor
    >>> y = codec.extract(msg)                                      # fp32, same shape
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hivemind.compression import CompressionBase, CompressionInfo, Float16Compression, NoCompression
from hivemind.proto import runtime_pb2

from p2pdiloco.config import CODECS  # noqa: E402  (one list of names, in the config)


class CodecError(ValueError):
    """A message that does not decode: wrong tag, wrong length. The round treats the part as bad."""


class BlockwiseQuantization(CompressionBase):
    """Blockwise absmax quantization to `bits` (8 or 4) with one fp32 scale per block."""

    # hivemind's enum has no value for us: the tag travels in the dtype field instead
    compression_type = runtime_pb2.CompressionType.NONE

    def __init__(self, bits: int, block_size: int):
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits}")
        self.bits, self.block_size = bits, block_size
        self.levels = 2 ** (bits - 1) - 1  # symmetric codes -L..L
        self.tag = f"p2pdiloco-int{bits}-b{block_size}"

    # --- the math -----------------------------------------------------------------------

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 scales (one per block) and int8 codes in [-L, L] (flat, padded to whole blocks)."""
        flat = x.detach().reshape(-1).float()
        pad = (-flat.numel()) % self.block_size
        blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, self.block_size)
        finite = torch.isfinite(blocks).all(dim=1)
        scales = blocks.abs().amax(dim=1).where(finite, torch.full_like(finite, math.nan, dtype=torch.float32))
        safe = torch.where(finite & (scales > 0), scales, torch.ones_like(scales))
        blocks = torch.where(finite[:, None], blocks, torch.zeros_like(blocks))
        codes = torch.round(blocks / safe[:, None] * self.levels).clamp_(-self.levels, self.levels).to(torch.int8)
        return scales, codes.view(-1)

    def dequantize(self, scales: torch.Tensor, codes: torch.Tensor, numel: int) -> torch.Tensor:
        blocks = codes.view(-1, self.block_size).float() * (scales[:, None] / self.levels)
        return blocks.view(-1)[:numel]

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        scales, codes = self.quantize(x)
        return self.dequantize(scales, codes, x.numel()).view(x.shape)

    @property
    def norm_slack(self) -> float:
        """max ||decode(encode(x))|| / ||x||: each block moves by at most sqrt(B) * s / (2L) <= ||block|| * that."""
        return 1.0 + math.sqrt(self.block_size) / (2 * self.levels)

    # --- hivemind's CompressionBase --------------------------------------------------------

    def compress(self, tensor: torch.Tensor, info: CompressionInfo = None, allow_inplace: bool = False
                 ) -> runtime_pb2.Tensor:
        scales, codes = self.quantize(tensor)
        packed = codes.numpy().astype(np.uint8) if self.bits == 8 else _pack4(codes, self.levels)
        return runtime_pb2.Tensor(compression=self.compression_type, dtype=self.tag, size=tensor.shape,
                                  buffer=scales.numpy().tobytes() + packed.tobytes(), requires_grad=False)

    def extract(self, serialized: runtime_pb2.Tensor) -> torch.Tensor:
        if serialized.dtype != self.tag:
            raise CodecError(f"expected a {self.tag} tensor, got dtype {serialized.dtype!r}")
        shape = tuple(serialized.size)
        numel = math.prod(shape)
        n_blocks = -(-numel // self.block_size)
        code_bytes = n_blocks * self.block_size * self.bits // 8
        if len(serialized.buffer) != 4 * n_blocks + code_bytes:
            raise CodecError(f"{self.tag} message of {len(serialized.buffer)} bytes for {numel} values")
        raw = np.frombuffer(serialized.buffer, dtype=np.uint8)
        scales = torch.from_numpy(raw[:4 * n_blocks].copy().view(np.float32))
        packed = raw[4 * n_blocks:]
        if self.bits == 8:
            codes = torch.from_numpy(packed.copy().view(np.int8))
        else:
            codes = _unpack4(packed, self.levels)
        if codes.numel() and int(codes.abs().max()) > self.levels:
            raise CodecError(f"{self.tag} code out of range")
        return self.dequantize(scales, codes, numel).view(shape)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return (self.bits + 32 / self.block_size) / 32

    def __repr__(self) -> str:
        return f"BlockwiseQuantization(bits={self.bits}, block_size={self.block_size})"


def _pack4(codes: torch.Tensor, levels: int) -> np.ndarray:
    """Two 4-bit codes per byte (code + L, in 0..2L), low nibble first."""
    u = (codes.numpy().astype(np.int16) + levels).astype(np.uint8)
    return (u[0::2] | (u[1::2] << 4)).astype(np.uint8)


def _unpack4(packed: np.ndarray, levels: int) -> torch.Tensor:
    out = np.empty(packed.size * 2, dtype=np.int8)
    out[0::2] = (packed & 0x0F).astype(np.int8) - levels
    out[1::2] = (packed >> 4).astype(np.int8) - levels
    return torch.from_numpy(out)


def make_codec(name: str) -> CompressionBase:
    """The codec for a `compression` config value."""
    if name == "none":
        return NoCompression()
    if name == "fp16":
        return Float16Compression()
    if name == "int8":
        return BlockwiseQuantization(8, block_size=256)
    if name == "int4":
        return BlockwiseQuantization(4, block_size=64)
    raise ValueError(f"compression must be one of {', '.join(CODECS)}, got {name!r}")


def bytes_per_value(name: str) -> float:
    """Wire bytes per pseudo-gradient value (payload only), for sizing parts and reporting."""
    codec = make_codec(name)
    if isinstance(codec, BlockwiseQuantization):
        return codec.estimate_compression_ratio(None) * 4
    return 2.0 if name == "fp16" else 4.0
