"""The live protocol's key names and record codecs: round trips, and malformed records
refused with an error naming the key and the field."""

from __future__ import annotations

import pytest

from lm_resiliency.live.keys import (
    Ack,
    CoordRecord,
    EpochRecord,
    Failure,
    Heartbeat,
    Join,
    Keys,
    Takeover,
    beat_value,
    decode,
    encode,
    encode_text,
    parse_beat,
)

_RECORDS = [
    CoordRecord(generation=2, pid=123, live_port=40000),
    EpochRecord(
        epoch=3,
        members=(0, 2),
        reason="lost",
        cause="r1g0 liveness EOF (pid 9)",
        resume_step=41,
        t_detect=1.5,
        t_publish=1.75,
        heal={"joiner": 1, "donor": 0, "step": 43},
        incarnations={"0/0": "a" * 32, "2/0": "b" * 32},
    ),
    EpochRecord(epoch=0, members=(), reason="below min_replicas"),
    Heartbeat(inc="c" * 32, epoch=1, committed=7, t=12.0),
    Failure(by="r0g1", reason="Connection reset by peer", t=3.0, inc="d" * 32),
    Ack(inc="e", committed=10, applied=11, shadow_of=11, in_flight=11, pid=77),
    Ack(inc="e", committed=10),
    Join(inc="f", host="node-1", pid=5, slot_step=9),
    Takeover(replica=1, inc="g" * 32, t=4.5),
]


@pytest.mark.parametrize("record", _RECORDS, ids=lambda r: type(r).__name__)
def test_every_record_round_trips(record) -> None:
    assert decode(type(record), encode(record), key="k") == record
    assert encode_text(record).encode() == encode(record)


def test_key_names_live_under_the_run() -> None:
    k = Keys("run-1")
    assert k.epoch == "lmr/live/run-1/epoch"
    assert k.epoch_record(3) == "lmr/live/run-1/epoch/3"
    assert k.heartbeat(1, 0) == "lmr/live/run-1/hb/1/0"
    assert k.ack(2, 1, 0) == "lmr/live/run-1/ack/2/1/0"
    assert k.failure(2) == "lmr/live/run-1/fail/2"
    assert k.join(1, 1) == "lmr/live/run-1/join/1/1"
    assert k.group_prefix(4, 0) == "lmr/live/run-1/pg/4/g0/"
    assert k.owner(1, 0) == "lmr/live/run-1/owner/1/0"
    assert k.spares == "lmr/live/run-1/spares"
    assert k.spare_take(2) == "lmr/live/run-1/spare/2/take"


@pytest.mark.parametrize("run", ["", "a/b", "tab\there"])
def test_a_bad_run_id_names_the_fix(run) -> None:
    with pytest.raises(ValueError, match="LMR_LIVE_RUN"):
        Keys(run)


def test_an_epoch_record_admits_only_its_member_incarnations() -> None:
    rec = _RECORDS[1]
    assert isinstance(rec, EpochRecord)
    assert rec.admits(0, 0, "a" * 32)
    assert not rec.admits(0, 0, "z" * 32)  # a fenced incarnation of a member replica
    assert not rec.admits(1, 0, "a" * 32)  # not a member
    assert rec.effective_step == 42


@pytest.mark.parametrize(
    ("kind", "raw", "fragment"),
    [
        (Heartbeat, b"{not json", "'hb/0/0' is not strict JSON"),
        (Heartbeat, b"[1, 2]", "'hb/0/0' is not a JSON object"),
        (Heartbeat, b'{"inc":"a","epoch":1,"committed":2,"t":NaN}', "not strict JSON"),
        (Heartbeat, b'{"inc":"a","epoch":1,"epoch":2,"committed":2,"t":1}', "not strict JSON"),
        (Heartbeat, b'{"inc":"a","epoch":1,"committed":2}', "is not a Heartbeat"),
        (Heartbeat, b'{"inc":"a","epoch":1,"committed":2,"t":1,"x":0}', "unknown fields ['x']"),
        (Heartbeat, b'{"inc":"a","epoch":"1","committed":2,"t":1}', "Heartbeat.epoch='1'"),
        (Heartbeat, b'{"inc":"a","epoch":true,"committed":2,"t":1}', "Heartbeat.epoch=True"),
        (Ack, b'{"inc":"a","committed":1,"applied":"2"}', "Ack.applied='2'"),
        (EpochRecord, b'{"epoch":1,"members":[0,"1"],"reason":"lost"}', "members must be a list"),
        (EpochRecord, b'{"epoch":1,"members":{},"reason":"lost"}', "members must be a list"),
        (EpochRecord, b'{"epoch":1,"members":[0],"reason":"lost","heal":{"joiner":"1"}}',
         "EpochRecord.heal="),
        (EpochRecord, b'{"epoch":1,"members":[0],"reason":"lost","incarnations":{"0/0":1}}',
         "EpochRecord.incarnations="),
        (Failure, b"\xff\xfe", "not strict JSON"),
    ],
)  # fmt: skip
def test_malformed_records_name_the_key_and_field(kind, raw, fragment) -> None:
    with pytest.raises(ValueError) as err:
        decode(kind, raw, key="hb/0/0")
    assert fragment in str(err.value)


def test_the_coordinator_beat_carries_the_published_epoch() -> None:
    assert parse_beat(beat_value(7, 3).encode()) == 3
    assert parse_beat(beat_value(1, -1).encode()) == -1
    assert parse_beat(b"5") == -1  # a bare counter: no epoch published
    with pytest.raises(ValueError, match="coord/beat value"):
        parse_beat(b"5 x")
