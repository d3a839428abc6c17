"""Each dataclass the orchestrator reports carries the same fields as its protobuf message, and converts
both ways without losing any (a field added to one but not the other fails here, not in production)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from openrl_lab.orchestrator import orchestrator_pb2 as pb
from openrl_lab.orchestrator import types as t

PAIRS = [
    (t.GroupInfo, pb.GroupInfo),
    (t.LeaseInfo, pb.Lease),
    (t.Grant, pb.Grant),
    (t.ReleaseResult, pb.ReleaseResponse),
    (t.LeaseEvent, pb.LeaseEvent),
    (t.QueueEntry, pb.QueueEntry),
    (t.DutyCycle, pb.DutyCycle),
    (t.GroupStatus, pb.GroupStatus),
    (t.SliceRecord, pb.SliceRecord),
    (t.Timeline, pb.GetTimelineResponse),
]
# Fields measured by the client itself, never sent: the time its evict callback took.
CLIENT_ONLY = {t.ReleaseResult: {"evict_s"}}


@pytest.mark.parametrize("cls, msg", PAIRS, ids=[c.__name__ for c, _ in PAIRS])
def test_each_dataclass_and_its_message_carry_the_same_fields(cls, msg):
    fields = {f.name for f in dataclasses.fields(cls)} - CLIENT_ONLY.get(cls, set())
    assert fields == set(msg.DESCRIPTOR.fields_by_name)


_NUMBERS = itertools.count(1)


def _sample(cls):
    """An instance of `cls` with every field set to a distinct non-default value (nested ones too)."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in CLIENT_ONLY.get(cls, ()):
            continue
        n, hint = next(_NUMBERS), f.type  # a string: types.py uses `from __future__ import annotations`
        nested = hint[len("tuple[") :].split(",")[0] if hint.startswith("tuple[") else hint.split(" |")[0]
        if hint.startswith("tuple[str"):
            kwargs[f.name] = (f"{f.name}-{n}",)
        elif hasattr(t, nested) and dataclasses.is_dataclass(getattr(t, nested)):
            one = _sample(getattr(t, nested))
            kwargs[f.name] = (one,) if hint.startswith("tuple[") else one
        else:
            scalar = hint.removesuffix(" | None")  # an optional number: -1 on the wire when None
            kwargs[f.name] = {"bool": True, "int": n, "float": n + 0.5}.get(scalar, f"{f.name}-{n}")
    return cls(**kwargs)


@pytest.mark.parametrize("cls, msg", PAIRS, ids=[c.__name__ for c, _ in PAIRS])
def test_every_field_survives_the_wire(cls, msg):
    obj = _sample(cls)
    assert t.from_proto(cls, t.to_proto(msg, obj)) == obj


@pytest.mark.parametrize("cls, msg", [(t.LeaseInfo, pb.Lease), (t.QueueEntry, pb.QueueEntry)])
def test_an_unknown_expected_wait_is_minus_one_on_the_wire_and_none_here(cls, msg):
    obj = _sample(cls)
    obj = dataclasses.replace(obj, expected_wait_s=None)
    wire = t.to_proto(msg, obj)
    assert wire.expected_wait_s == -1.0
    assert t.from_proto(cls, wire).expected_wait_s is None
    assert t.from_proto(cls, t.to_proto(msg, dataclasses.replace(obj, expected_wait_s=0.0))).expected_wait_s == 0.0
