"""The service's wire protocol and config JSON: every message round-trips, every bad frame is a
``ProtocolError`` naming what is wrong, and a client speaking garbage, saying nothing, never
reading its replies or coming one connection too many is cut off (and told why) while the service
keeps serving everyone else."""

from __future__ import annotations

import io
import logging
import socket
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dstl import ChangelogConfig, ChangelogHandle, HedgingPolicy, KeyGroupRange, S3Options, SegmentRef
from dstl.errors import (
    ChangelogError,
    ConfigurationError,
    CorruptChangelogError,
    StorageError,
    UploadFailedError,
    WriterClosedError,
)
from dstl.service import FencedWriterError, ProtocolError, ServiceUnavailableError, service_socket_path
from dstl.service.appends import Append, append_frames
from dstl.service.configjson import config_from_json, config_to_json, dumps_config, fingerprint, loads_config
from dstl.service.framing import HEADER, MAX_CONTROL_PAYLOAD, MAX_PAYLOAD, MAX_SMALL_PAYLOAD, Kind, read_frame
from dstl.service.protocol import (
    PROTOCOL_VERSION,
    Ack,
    CloseWriter,
    Confirm,
    Error,
    Hello,
    LastSqn,
    Message,
    Opened,
    OpenWriter,
    Persist,
    Persisted,
    Ping,
    Pong,
    Release,
    Sqn,
    Truncate,
    Welcome,
    decode,
    encode,
    error_from_reply,
    error_reply,
    read_message,
)
from tests.dstl.service.harness import WAIT_S, Harness, append_all, local_config, make_records

HANDLE = ChangelogHandle(
    "op.e3-0-9-0123456789ab",
    KeyGroupRange(0, 9),
    after=2,
    upto=5,
    segments=(SegmentRef("dstl/0a/abc", 10, 200, 3, 17, 0, 9), SegmentRef("dstl/1b/def", 0, 50, 5, 2, 4, 4)),
)

MESSAGES: list[Message] = [
    Hello(PROTOCOL_VERSION, "f" * 64),
    Welcome(7, 4242),
    OpenWriter("op-ü", KeyGroupRange(3, 17)),
    OpenWriter("empty", KeyGroupRange.empty()),
    Opened(1, "op.e7-3-17-abc"),
    LastSqn(2),
    Sqn(2**63),
    Persist(2, 0),
    Persisted(HANDLE),
    Truncate(2, 6),
    Confirm(2, HANDLE),
    Release((1 << 32) - 1, HANDLE),
    CloseWriter(2),
    Ack(),
    Error("FencedWriterError", "writer x was taken over"),
    Ping(),
    Pong(7, 4242),
    Append(9, [0, b"", 65535, b"\x00" * 3, 7, "é".encode()]),
]


def frame(kind: int, payload: bytes, request_id: int = 1) -> bytes:
    return HEADER.pack(len(payload), kind, request_id) + payload


# -- round trips ------------------------------------------------------------------------------------


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message: Message) -> None:
    data = encode(message, 99)
    assert read_message(io.BytesIO(data)) == (99, message)
    length, kind, request_id = HEADER.unpack(data[: HEADER.size])
    assert (length, kind, request_id) == (len(data) - HEADER.size, message.KIND, 99)
    assert decode(kind, data[HEADER.size :]) == message


def test_frames_follow_each_other_and_a_clean_end_is_none() -> None:
    stream = io.BytesIO(b"".join(encode(m, i) for i, m in enumerate(MESSAGES)))
    assert [read_message(stream) for _ in MESSAGES] == list(enumerate(MESSAGES))
    assert read_message(stream) is None


pairs_strategy = st.lists(st.tuples(st.integers(0, 65535), st.binary(max_size=300)), max_size=60).map(
    lambda items: [x for pair in items for x in pair]
)


@given(writer=st.integers(0, (1 << 32) - 1), pairs=pairs_strategy, max_bytes=st.integers(1, 2000))
def test_append_frames_round_trip_in_order_and_bounded(writer: int, pairs: list[Any], max_bytes: int) -> None:
    assert Append.parse(Append(writer, pairs).payload()) == Append(writer, pairs)
    stream = io.BytesIO(b"".join(append_frames(writer, pairs, max_bytes)))
    decoded: list[Any] = []
    while (got := read_message(stream)) is not None:
        _, message = got
        assert isinstance(message, Append) and message.writer == writer
        payload_bytes = sum(map(len, message.pairs[1::2]))
        assert payload_bytes <= max_bytes or len(message.pairs) == 2  # one change larger than the bound
        decoded += message.pairs
    assert decoded == pairs
    assert all(type(p) is bytes for p in decoded[1::2])


@pytest.mark.parametrize(
    ("pairs", "problem"),
    [
        ([0, "text"], "changes must be bytes, got str"),
        ([0, bytearray(b"x")], "changes must be bytes, got bytearray"),
        ([65536, b"x"], "key group 65536 is not an integer in [0, 65535]"),
        ([-1, b"x"], "key group -1"),
        (["7", b"x"], "key group '7'"),
    ],
)
def test_bad_changes_are_refused_when_encoded(pairs: list[Any], problem: str) -> None:
    with pytest.raises(ConfigurationError) as exc_info:
        append_frames(1, pairs, 1024)
    assert problem in str(exc_info.value)


# -- bad frames --------------------------------------------------------------------------------------


def append_payload(n: int, key_groups: bytes, lengths: bytes, data: bytes) -> bytes:
    return struct.pack("<II", 1, n) + key_groups + lengths + data


BAD_FRAMES = {
    "truncated header": (b"\x05\x00\x00", "header of 9 bytes ended after 3"),
    "truncated payload": (HEADER.pack(10, Kind.ACK, 1) + b"{}", "payload of kind 68 of 10 bytes ended after 2"),
    "oversized": (HEADER.pack(MAX_PAYLOAD + 1, Kind.APPEND, 1), f"more than the bound {MAX_PAYLOAD}"),
    "unknown kind": (frame(200, b"{}"), "unknown frame kind 200"),
    "oversized control message": (
        HEADER.pack(MAX_CONTROL_PAYLOAD + 1, Kind.CONFIRM, 1),
        f"CONFIRM frame announces {MAX_CONTROL_PAYLOAD + 1} bytes, more than the {MAX_CONTROL_PAYLOAD} allowed",
    ),
    "oversized hello": (
        HEADER.pack(MAX_SMALL_PAYLOAD + 1, Kind.HELLO, 1),
        f"HELLO frame announces {MAX_SMALL_PAYLOAD + 1} bytes, more than the {MAX_SMALL_PAYLOAD} allowed",
    ),
    "bad UTF-8": (frame(Kind.HELLO, b'{"version": "\xff"}'), "HELLO payload is not UTF-8"),
    "not JSON": (frame(Kind.PERSIST, b"{writer: 1"), "PERSIST payload is not JSON"),
    "huge integer": (frame(Kind.SQN, b'{"sqn": ' + b"9" * 5000 + b"}"), "SQN payload is not JSON"),
    "not an object": (frame(Kind.ACK, b"[]"), "ACK payload is not a JSON object: list"),
    "missing field": (frame(Kind.PERSIST, b'{"writer": 1}'), "PERSIST lacks the field 'after'"),
    "wrong type": (frame(Kind.LAST_SQN, b'{"writer": "1"}'), "LAST_SQN field 'writer' must be an integer"),
    "bool for int": (frame(Kind.LAST_SQN, b'{"writer": true}'), "LAST_SQN field 'writer' must be an integer"),
    "negative": (frame(Kind.TRUNCATE, b'{"writer": 1, "before": -1}'), "field 'before' must be an integer in [0,"),
    "writer past u32": (frame(Kind.CLOSE_WRITER, b'{"writer": 4294967296}'), "in [0, 4294967295]"),
    "bad handle": (frame(Kind.CONFIRM, b'{"writer": 1, "handle": {"log_id": "x"}}'), "CONFIRM field 'handle'"),
    "bad key groups": (
        frame(Kind.OPEN_WRITER, b'{"operator_id": "op", "key_group_range": [0, 40000]}'),
        "OPEN_WRITER field 'key_group_range'",
    ),
    "string for text": (frame(Kind.ERROR, b'{"type": 1, "message": "m"}'), "ERROR field 'type' must be a string"),
    "short append": (frame(Kind.APPEND, b"\x01\x00"), "shorter than its 8-byte header"),
    "append columns cut": (frame(Kind.APPEND, append_payload(3, b"\x00" * 6, b"", b"")), "3 changes needs 26 bytes"),
    "append lengths too long": (
        frame(Kind.APPEND, append_payload(1, b"\x00\x00", struct.pack("<I", 5), b"abc")),
        "lengths add up to 5 bytes of changes but 3 follow",
    ),
    "append trailing bytes": (
        frame(Kind.APPEND, append_payload(1, b"\x00\x00", struct.pack("<I", 1), b"abc")),
        "lengths add up to 1 bytes of changes but 3 follow",
    ),
}


@pytest.mark.parametrize("name", list(BAD_FRAMES))
def test_a_bad_frame_is_a_protocol_error_naming_the_problem(name: str) -> None:
    data, problem = BAD_FRAMES[name]
    with pytest.raises(ProtocolError) as exc_info:
        read_message(io.BytesIO(data))
    assert problem in str(exc_info.value)


def test_an_oversized_frame_is_refused_before_its_payload_is_read() -> None:
    class HeaderOnly(io.RawIOBase):
        def __init__(self) -> None:
            self.data = HEADER.pack(MAX_PAYLOAD + 1, Kind.APPEND, 1)
            self.asked: list[int] = []

        def read(self, size: int = -1) -> bytes:
            self.asked.append(size)
            out, self.data = self.data[:size], self.data[size:]
            return out

    stream = HeaderOnly()
    with pytest.raises(ProtocolError, match="more than the bound"):
        read_frame(stream)
    assert stream.asked == [HEADER.size]


# -- errors across the socket --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "name"),
    [
        (FencedWriterError("w"), "FencedWriterError"),
        (UploadFailedError("u"), "UploadFailedError"),
        (ConfigurationError("c"), "ConfigurationError"),
        (CorruptChangelogError("f", "bad"), "ChangelogError"),  # nearest whitelisted base
        (ValueError("v"), "StorageError"),
    ],
)
def test_errors_cross_by_their_whitelisted_class_name(exc: Exception, name: str) -> None:
    reply = error_reply(exc)
    assert reply.type == name and reply.message == str(exc)
    raised = error_from_reply(reply, "changelog service /s: persist_durably of writer w")
    assert type(raised).__name__ == name
    assert str(raised) == f"changelog service /s: persist_durably of writer w: {exc}"


def test_an_unknown_error_type_is_a_storage_error() -> None:
    raised = error_from_reply(Error("KeyboardInterrupt", "boom"), "ctx")
    assert type(raised) is StorageError and str(raised) == "ctx: boom"
    assert issubclass(ServiceUnavailableError, StorageError) and issubclass(ServiceUnavailableError, WriterClosedError)
    assert issubclass(FencedWriterError, WriterClosedError) and issubclass(ProtocolError, ChangelogError)


# -- configuration JSON ------------------------------------------------------------------------------

VARIED = ChangelogConfig(
    base_path="s3://bucket/prefix",
    persist_delay_ms=0.5,
    persist_size_threshold=123,
    max_in_flight_bytes=4567,
    hedging=HedgingPolicy(percentile=0.9, second_percentile=None, min_delay_ms=0.25, budget=0.5),
    s3=S3Options(
        endpoint_url="http://127.0.0.1:9",
        region="eu-west-1",
        access_key_id="AKIA",
        secret_access_key="s3cr3t",
        session_token="tok",
        force_close=True,
    ),
)


@pytest.mark.parametrize("config", [ChangelogConfig.local("/tmp/x"), VARIED], ids=["defaults", "varied"])
def test_config_round_trips_through_json(config: ChangelogConfig) -> None:
    assert loads_config(dumps_config(config)) == config
    assert config_from_json(config_to_json(config)) == config


def test_fingerprint_names_a_configuration_not_its_spelling() -> None:
    assert fingerprint(ChangelogConfig.local("/d", persist_delay_ms=10)) == fingerprint(ChangelogConfig.local("/d"))
    assert fingerprint(VARIED) != fingerprint(ChangelogConfig.local("/d"))
    secret = config_to_json(VARIED)
    secret["s3"]["secret_access_key"] = "other"
    assert fingerprint(config_from_json(secret)) != fingerprint(VARIED)
    a, b = ChangelogConfig.local("/a"), ChangelogConfig.local("/b")
    assert service_socket_path(a, "/tmp/s") != service_socket_path(b, "/tmp/s")


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda d: d.update(extra=1), "unknown field(s) extra"),
        (lambda d: d["hedging"].update(typo=1), "unknown field(s) hedging.typo"),
        (lambda d: d.pop("max_attempts"), "missing field max_attempts"),
        (lambda d: d.update(max_attempts="3"), "max_attempts must be int"),
        (lambda d: d.update(max_attempts=True), "max_attempts must be int"),
        (lambda d: d["s3"].update(force_close=1), "s3.force_close must be bool"),
        (lambda d: d.update(hedging=[]), "hedging. must be an object"),
        (lambda d: d.update(max_attempts=0), "max_attempts must be positive"),
    ],
)
def test_a_malformed_config_json_names_the_field(change: Any, problem: str) -> None:
    value = config_to_json(ChangelogConfig.local("/tmp/x"))
    change(value)
    with pytest.raises(ConfigurationError) as exc_info:
        config_from_json(value)
    assert problem in str(exc_info.value)
    with pytest.raises(ConfigurationError, match="not JSON"):
        loads_config("{")


# -- a garbage client --------------------------------------------------------------------------------


def talk(path: str, data: bytes) -> bytes:
    """Send ``data`` on a raw connection and read until the service closes it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(WAIT_S)
        sock.connect(path)
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        return received


@pytest.mark.parametrize(
    ("garbage", "problem"),
    [
        (b"\xff" * 64, "more than the bound"),
        (frame(42, b"x"), "unknown frame kind 42"),
        (HEADER.pack(4096, Kind.APPEND, 1), "APPEND frame announces 4096 bytes, more than the 512 allowed for it here"),
        (encode(LastSqn(1), 1), "the first frame must be HELLO, got LAST_SQN"),
        (encode(Hello(PROTOCOL_VERSION + 1, "x"), 1), f"protocol version {PROTOCOL_VERSION + 1} is not spoken"),
        (frame(Kind.HELLO, b"\xc3\x28"), "HELLO payload is not UTF-8"),
    ],
)
def test_a_garbage_client_is_cut_off_and_the_service_keeps_serving(
    tmp_path: Path, harness: Harness, garbage: bytes, problem: str
) -> None:
    config = local_config(tmp_path)
    service = harness.serve(config)
    storage = harness.client(config, start=False)
    writer = storage.create_writer("op", KeyGroupRange(0, 3))
    before = make_records(range(4), "before", 50)
    append_all(writer, before)

    replies = io.BytesIO(talk(service.socket_path, garbage))
    got = read_message(replies)  # the service says why, then closes
    assert got is not None and isinstance(got[1], Error) and got[1].type == "ProtocolError"
    assert problem in got[1].message
    assert read_message(replies) is None

    after = make_records(range(4), "after", 50)
    append_all(writer, after)
    handle = writer.persist_durably(0).result(WAIT_S)
    assert list(storage.read(handle)) == before + after


def test_a_garbage_frame_after_hello_ends_only_that_connection(tmp_path: Path, harness: Harness) -> None:
    config = local_config(tmp_path)
    service = harness.serve(config)
    storage = harness.client(config, start=False)
    writer = storage.create_writer("op", KeyGroupRange(0, 3))
    hello = encode(Hello(PROTOCOL_VERSION, fingerprint(config)), 1)
    replies = io.BytesIO(talk(service.socket_path, hello + frame(Kind.APPEND, b"\x01")))
    welcome = read_message(replies)
    assert welcome is not None and isinstance(welcome[1], Welcome) and welcome[1].epoch == service.epoch
    error = read_message(replies)
    assert error is not None and isinstance(error[1], Error) and "shorter than its 8-byte header" in error[1].message
    records = make_records(range(4), "ok", 20)
    append_all(writer, records)
    assert list(storage.read(writer.persist_durably(0).result(WAIT_S))) == records


def test_a_client_that_says_nothing_is_cut_off_at_the_hello_deadline(tmp_path: Path, harness: Harness) -> None:
    service = harness.serve(local_config(tmp_path), hello_timeout_s=0.2)
    replies = io.BytesIO(talk(service.socket_path, b""))
    got = read_message(replies)
    assert got == (0, Error("ProtocolError", "no HELLO within 0.2 s"))
    assert read_message(replies) is None


def test_a_client_that_never_reads_its_replies_is_cut_off(
    tmp_path: Path, harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    config = local_config(tmp_path)
    service = harness.serve(config, max_queued_replies=4)
    caplog.set_level(logging.WARNING, logger="dstl.service.handler")
    requests = b"".join(encode(LastSqn(7), i + 1) for i in range(1000))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(WAIT_S)
        sock.connect(service.socket_path)
        sock.sendall(encode(Hello(PROTOCOL_VERSION, fingerprint(config)), 1))
        with pytest.raises(OSError):  # the service shuts the connection: sending fails
            for _ in range(10_000):  # the replies fill the socket, then the bounded queue
                sock.sendall(requests)
    assert "does not read its replies (4 queued): cutting it off" in caplog.text
    storage = harness.client(config, start=False)  # everyone else is served
    writer = storage.create_writer("op", KeyGroupRange(0, 3))
    writer.append(0, b"x")
    assert writer.last_appended_sqn() == 1


def test_one_connection_more_than_the_bound_is_told_why(tmp_path: Path, harness: Harness) -> None:
    config = local_config(tmp_path)
    service = harness.serve(config, max_connections=1)
    first = harness.client(config, start=False)
    with pytest.raises(ServiceUnavailableError) as exc_info:
        harness.client(config, start=False)
    assert (
        f"changelog service {service.socket_path} unavailable: hello failed: the service ended the connection: "
        f"ServiceUnavailableError: the changelog service on {service.socket_path} serves at most 1 connections"
    ) in str(exc_info.value)
    writer = first.create_writer("op", KeyGroupRange(0, 3))
    writer.append(0, b"x")
    assert writer.last_appended_sqn() == 1
