"""Our blockwise 8-bit and 4-bit pseudo-gradient codecs: exact math, error bounds, bad messages."""

from __future__ import annotations

import math

import pytest
import torch
from hivemind.compression import CompressionInfo

from p2pdiloco.compression import BlockwiseQuantization, CodecError, bytes_per_value, make_codec


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("numel", [1, 63, 64, 1000, 70_001])
def test_round_trip_error_is_bounded_per_block(name, numel):
    codec = make_codec(name)
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g) * torch.rand(numel, generator=g) ** 3  # heavy-tailed like a pseudo-grad
    msg = codec.compress(x, CompressionInfo.from_tensor(x))
    y = codec.extract(msg)
    assert y.dtype == torch.float32 and y.shape == x.shape
    B, L = codec.block_size, codec.levels
    pad = (-numel) % B
    xb = torch.nn.functional.pad(x, (0, pad)).view(-1, B)
    yb = torch.nn.functional.pad(y, (0, pad)).view(-1, B)
    bound = xb.abs().amax(dim=1, keepdim=True) / (2 * L) * (1 + 1e-5) + 1e-12
    assert bool(((xb - yb).abs() <= bound).all())
    assert float(y.norm()) <= float(x.norm()) * codec.norm_slack
    # the wire size is the payload the config promises
    assert len(msg.buffer) == math.ceil(numel / B) * (4 + B * codec.bits // 8)


def test_reference_values():
    codec = BlockwiseQuantization(4, block_size=4)
    x = torch.tensor([0.7, -0.35, 0.1, 0.0, 2.0, 1.0, -2.0, 0.29])
    # block 1: scale 0.7, codes round(x / 0.7 * 7) = 7, -3.5 -> -4 (half away: torch rounds half to even: -4), 1, 0
    scales, codes = codec.quantize(x)
    assert scales.tolist() == pytest.approx([0.7, 2.0])
    assert codes.tolist() == [7, -4, 1, 0, 7, 4, -7, 1]
    y = codec.roundtrip(x)
    assert y.tolist() == pytest.approx([0.7, -0.4, 0.1, 0.0, 2.0, 8 / 7, -2.0, 2 / 7], abs=1e-6)


def test_extract_is_deterministic_and_zero_blocks_stay_zero():
    codec = make_codec("int8")
    x = torch.zeros(600)
    x[300:] = torch.linspace(-1, 1, 300)
    a, b = codec.extract(codec.compress(x)), codec.extract(codec.compress(x))
    assert torch.equal(a, b)
    assert bool((a[:256] == 0).all())


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_non_finite_blocks_decode_to_nan_so_receivers_reject_them(name):
    codec = make_codec(name)
    x = torch.randn(3 * codec.block_size)
    x[codec.block_size + 5] = float("inf")
    y = codec.extract(codec.compress(x))
    assert bool(torch.isfinite(y[:codec.block_size]).all())
    assert bool(torch.isnan(y[codec.block_size:2 * codec.block_size]).all())
    assert bool(torch.isfinite(y[2 * codec.block_size:]).all())


def test_malformed_messages_raise_codec_error():
    codec = make_codec("int4")
    msg = codec.compress(torch.randn(100))
    short = type(msg)()
    short.CopyFrom(msg)
    short.buffer = msg.buffer[:-1]
    with pytest.raises(CodecError):
        codec.extract(short)
    other = type(msg)()
    other.CopyFrom(msg)
    other.dtype = "float32"
    with pytest.raises(CodecError):
        codec.extract(other)
    bad_code = type(msg)()
    bad_code.CopyFrom(msg)
    bad_code.buffer = msg.buffer[:-1] + b"\xff"  # nibble 15 - 7 = 8 > L
    with pytest.raises(CodecError):
        codec.extract(bad_code)


def test_bytes_per_value():
    assert bytes_per_value("none") == 4 and bytes_per_value("fp16") == 2
    assert 1.0 < bytes_per_value("int8") < 1.02
    assert 0.5 < bytes_per_value("int4") < 0.57
