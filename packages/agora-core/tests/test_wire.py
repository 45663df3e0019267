"""Wire format: encoding, per-chunk codec choice, and strict, bounded decoding."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import zmq

from agora_core.errors import LimitExceeded, MalformedMessage, UnsupportedProtocolVersion, WireError
from agora_core.wire.codec import CODEC_LZ4, CODEC_RAW, CompressionPolicy
from agora_core.wire.dtypes import SUPPORTED_DTYPES, TaggedArray, storage_dtype
from agora_core.wire.message import PROTOCOL_VERSION, Kind, Message, WireConfig, WireLimits, decode, encode

CONFIG = WireConfig()
SMALL_CHUNKS = WireConfig(chunk_bytes=4096)


def roundtrip(tensors, config=CONFIG, **fields):
    frames = encode(Message(kind=Kind.REQUEST, method="m", request_id=7, tensors=tensors, **fields), config)
    # What a receiver gets from zmq: independent byte buffers.
    return decode([bytes(f) for f in frames], config.limits)


def sample_array(dtype: str, shape, rng) -> np.ndarray | TaggedArray:
    storage = storage_dtype(dtype)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * storage.itemsize, dtype=np.uint8)
    array = raw.view(storage).reshape(shape)
    return TaggedArray(dtype, array) if dtype == "bfloat16" else array


def assert_bits_equal(a, b) -> None:
    if isinstance(a, TaggedArray):
        assert isinstance(b, TaggedArray) and a.dtype == b.dtype
        a, b = a.words, b.words
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()  # bit-exact, NaN payloads included


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
def test_every_dtype_round_trips_bit_exactly(dtype):
    rng = np.random.default_rng(0)
    tensor = sample_array(dtype, (3, 5, 7), rng)
    out = roundtrip({"x": tensor}).tensors["x"]
    assert_bits_equal(tensor, out)


def test_bfloat16_words_keep_special_values():
    # +0, -0, 1.0, -inf, +inf, a quiet NaN, a signalling-NaN payload, the smallest subnormal
    words = np.array([0x0000, 0x8000, 0x3F80, 0xFF80, 0x7F80, 0x7FC0, 0x7F81, 0x0001], dtype=np.uint16)
    out = roundtrip({"w": TaggedArray("bfloat16", words)}).tensors["w"]
    assert isinstance(out, TaggedArray) and out.dtype == "bfloat16"
    assert out.words.tolist() == words.tolist()


def test_bfloat16_from_raw_buffer():
    words = np.arange(6, dtype=np.uint16)
    tagged = TaggedArray.from_buffer("bfloat16", (2, 3), words.tobytes())
    assert roundtrip({"b": tagged}).tensors["b"] == tagged
    with pytest.raises(ValueError, match="needs 4"):
        TaggedArray.from_buffer("bfloat16", (2, 2), words.tobytes())


@pytest.mark.parametrize(
    "tensor",
    [
        np.array(3.5, dtype=np.float64),  # 0-d
        np.zeros((0,), dtype=np.float32),
        np.zeros((4, 0, 3), dtype=np.int16),
        np.arange(24, dtype=np.int32).reshape(4, 6)[:, ::2],  # non-contiguous
        np.arange(24, dtype=np.float32).reshape(4, 6).T,  # Fortran order
        np.arange(10, dtype=">f4"),  # big-endian input
        np.array([True, False, True]),
    ],
    ids=["0d", "empty", "empty-nd", "strided", "transposed", "big-endian", "bool"],
)
def test_awkward_arrays_round_trip(tensor):
    out = roundtrip({"t": tensor}).tensors["t"]
    assert out.shape == tensor.shape
    assert out.dtype.newbyteorder("=") == tensor.dtype.newbyteorder("=")
    np.testing.assert_array_equal(out, tensor)


def test_multi_chunk_tensor_with_mixed_codecs_round_trips():
    rng = np.random.default_rng(1)
    data = rng.standard_normal(8192).astype(np.float32)  # 32 KiB = 8 chunks of 4 KiB
    data[2048:4096] = 0.0  # chunks 2 and 3 compress, the rest do not
    frames = encode(Message(kind=Kind.REQUEST, tensors={"x": data}), SMALL_CHUNKS)
    descriptor = msgpack.unpackb(frames[0])["tensors"][0]
    assert descriptor["chunks"] == 8
    assert descriptor["codecs"] == [CODEC_RAW] * 2 + [CODEC_LZ4] * 2 + [CODEC_RAW] * 4
    assert len(frames) == 1 + 4  # raw run, lz4, lz4, raw run: raw chunks share frames
    out = decode([bytes(f) for f in frames], SMALL_CHUNKS.limits).tensors["x"]
    np.testing.assert_array_equal(out, data)


def test_random_floats_are_sent_raw_and_zeros_compressed():
    rng = np.random.default_rng(2)
    noisy = rng.random(1 << 20, dtype=np.float32)  # 4 MiB
    sparse = np.zeros(1 << 20, dtype=np.float32)
    sparse[::97] = 1.0
    frames = encode(Message(kind=Kind.REQUEST, tensors={"noisy": noisy, "sparse": sparse}), CONFIG)
    noisy_desc, sparse_desc = msgpack.unpackb(frames[0])["tensors"]
    assert set(noisy_desc["codecs"]) == {CODEC_RAW}
    assert set(sparse_desc["codecs"]) == {CODEC_LZ4}
    assert sum(sparse_desc["sizes"]) < sparse.nbytes / 10


def test_raw_single_frame_is_decoded_without_copy():
    data = np.random.default_rng(3).random(1000)
    frames = encode(Message(kind=Kind.REQUEST, tensors={"x": data}), CONFIG)
    buffer = bytearray(frames[1])
    out = decode([frames[0], buffer], CONFIG.limits).tensors["x"]
    buffer[:8] = bytes(8)  # the decoded array views the received frame
    assert out[0] == 0.0


def test_an_array_spanning_a_whole_received_frame_goes_back_as_that_frame():
    # A reducer returns a difference in the buffer the chunk came in: the encoder hands the
    # transport the buffer's own object (zmq passes a Frame on by reference, no new frame).
    data = np.random.default_rng(4).random(1 << 15)
    frames = encode(Message(kind=Kind.STREAM, tensors={"x": data}, compress=False), CONFIG)
    received = zmq.Frame(bytes(frames[1]))
    values = decode([frames[0], received], CONFIG.limits).tensors["x"]
    values -= 1.0  # computed in place
    out = encode(Message(kind=Kind.STREAM, tensors={"delta": values}, compress=False), CONFIG)
    assert out[1] is received
    assert np.array_equal(decode(out, CONFIG.limits).tensors["delta"], data - 1.0)
    # Part of a frame, or an array over plain bytes, still goes as a view of its own bytes.
    part = encode(Message(kind=Kind.STREAM, tensors={"d": values[1:]}, compress=False), CONFIG)
    assert isinstance(part[1], memoryview) and part[1].nbytes == values[1:].nbytes
    over_bytes = decode([frames[0], bytes(frames[1])], CONFIG.limits).tensors["x"]
    assert isinstance(encode(Message(kind=Kind.STREAM, tensors={"d": over_bytes}), CONFIG)[1], memoryview)


def test_compression_can_be_disabled():
    config = WireConfig(compression=CompressionPolicy(enabled=False))
    frames = encode(Message(kind=Kind.REQUEST, tensors={"z": np.zeros(1 << 16)}), config)
    assert msgpack.unpackb(frames[0])["tensors"][0]["codecs"] == [CODEC_RAW]


def test_one_message_can_opt_out_of_compression():
    zeros = {"z": np.zeros(1 << 16)}
    assert msgpack.unpackb(encode(Message(kind=Kind.STREAM, tensors=zeros), CONFIG)[0])["tensors"][0][
        "codecs"
    ] != [CODEC_RAW]
    frames = encode(Message(kind=Kind.STREAM, tensors=zeros, compress=False), CONFIG)
    assert set(msgpack.unpackb(frames[0])["tensors"][0]["codecs"]) == {CODEC_RAW}
    assert np.array_equal(decode(frames, CONFIG.limits).tensors["z"], zeros["z"])


def test_metadata_and_fields_round_trip():
    meta = {"step": 3, "names": ["a", "b"], "nested": {"x": 1.5}, "blob": b"\x00\x01"}
    message = roundtrip({}, meta=meta, deadline_s=2.5, sender="node-1")
    assert (message.meta, message.deadline_s, message.sender, message.request_id) == (meta, 2.5, "node-1", 7)


# --- strict decoding -----------------------------------------------------------------------


def valid_frames(tensors=None, config=CONFIG):
    frames = encode(Message(kind=Kind.REQUEST, method="m", request_id=1, tensors=tensors or {}), config)
    return [bytes(f) for f in frames]


def with_header(frames, **changes):
    header = msgpack.unpackb(frames[0])
    for key, value in changes.items():
        header[key] = value
    return [msgpack.packb(header), *frames[1:]]


def with_descriptor(frames, **changes):
    header = msgpack.unpackb(frames[0])
    header["tensors"][0].update(changes)
    return [msgpack.packb(header), *frames[1:]]


def test_unknown_major_version_is_refused_with_a_clear_error():
    with pytest.raises(UnsupportedProtocolVersion, match="protocol 9"):
        decode(with_header(valid_frames(), v=[9, 0]), CONFIG.limits)


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [b"\xc1garbage"],
        [msgpack.packb([1, 2, 3])],
        [msgpack.packb({"v": list(PROTOCOL_VERSION), "kind": 99, "id": 1})],
        [msgpack.packb({"v": list(PROTOCOL_VERSION), "kind": 1, "id": -5})],
        [msgpack.packb({"v": list(PROTOCOL_VERSION), "kind": 1, "id": 1, "method": 5})],
        [msgpack.packb({"v": list(PROTOCOL_VERSION), "kind": 1, "id": 1, "tensors": "x"})],
        [msgpack.packb({"v": list(PROTOCOL_VERSION), "kind": 1, "id": 1, "deadline_s": "soon"})],
    ],
    ids=[
        "empty",
        "garbage",
        "not-a-map",
        "bad-kind",
        "negative-id",
        "bad-method",
        "bad-tensors",
        "bad-deadline",
    ],
)
def test_malformed_headers_raise_typed_errors(frames):
    with pytest.raises(MalformedMessage):
        decode(frames, CONFIG.limits)


def test_truncated_data_frame_is_rejected():
    frames = valid_frames({"x": np.arange(100, dtype=np.float32)})
    with pytest.raises(MalformedMessage, match="bytes, header declares"):
        decode([frames[0], frames[1][:-4]], CONFIG.limits)


def test_missing_and_extra_frames_are_rejected():
    frames = valid_frames({"x": np.arange(100, dtype=np.float32)})
    with pytest.raises(MalformedMessage, match="data frames"):
        decode(frames[:1], CONFIG.limits)
    with pytest.raises(MalformedMessage, match="data frames"):
        decode([*frames, b"extra"], CONFIG.limits)


def test_corrupt_lz4_chunk_is_rejected():
    frames = valid_frames({"z": np.zeros(4096, dtype=np.float32)}, SMALL_CHUNKS)
    header = msgpack.unpackb(frames[0])
    assert header["tensors"][0]["codecs"][0] == CODEC_LZ4
    corrupt = bytes([0xFF]) * len(frames[1])
    with pytest.raises(MalformedMessage, match="LZ4"):
        decode([frames[0], corrupt, *frames[2:]], SMALL_CHUNKS.limits)


def test_huge_declared_shape_is_refused_before_allocation():
    frames = valid_frames({"x": np.zeros(4, dtype=np.float32)})
    # 2^40 float64 elements would be 8 TiB: decoding must refuse, not attempt the allocation.
    with pytest.raises(LimitExceeded):
        decode(with_descriptor(frames, shape=[1 << 40], dtype="float64"), CONFIG.limits)


def test_declared_sizes_must_match_the_shape():
    frames = valid_frames({"x": np.zeros(4, dtype=np.float32)})
    with pytest.raises(MalformedMessage):
        decode(with_descriptor(frames, shape=[8]), CONFIG.limits)
    with pytest.raises(MalformedMessage):
        decode(with_descriptor(frames, sizes=[15]), CONFIG.limits)
    with pytest.raises(MalformedMessage):
        decode(with_descriptor(frames, codecs=[7]), CONFIG.limits)
    with pytest.raises(MalformedMessage, match="unsupported dtype"):
        decode(with_descriptor(frames, dtype="float128"), CONFIG.limits)
    with pytest.raises(LimitExceeded):
        decode(with_descriptor(frames, shape=[1] * 20), CONFIG.limits)


def test_message_limits_apply_on_both_sides():
    limits = WireLimits(max_message_bytes=1 << 16, max_tensor_bytes=1 << 16)
    config = WireConfig(chunk_bytes=4096, limits=limits)
    big = {"x": np.zeros(1 << 15, dtype=np.float32)}  # 128 KiB
    with pytest.raises(LimitExceeded):
        encode(Message(kind=Kind.REQUEST, tensors=big), config)
    frames = valid_frames(big)  # a sender with larger limits
    with pytest.raises(LimitExceeded):
        decode(frames, limits)
    with pytest.raises(LimitExceeded):
        decode(frames, WireLimits(max_header_bytes=16))


def test_unencodable_input_raises_wire_errors():
    with pytest.raises(WireError, match="msgpack"):
        encode(Message(kind=Kind.REQUEST, meta={"x": object()}), CONFIG)
    with pytest.raises(TypeError, match="cannot travel"):
        encode(Message(kind=Kind.REQUEST, tensors={"x": np.array(["a"])}), CONFIG)
    with pytest.raises(TypeError, match=r"numpy\.ndarray or TaggedArray"):
        encode(Message(kind=Kind.REQUEST, tensors={"x": [1, 2]}), CONFIG)
