from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GroupInfo(_message.Message):
    __slots__ = ("group_id", "aliases", "devices", "policy", "max_phase_s")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    MAX_PHASE_S_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    aliases: _containers.RepeatedScalarFieldContainer[str]
    devices: _containers.RepeatedScalarFieldContainer[str]
    policy: str
    max_phase_s: float
    def __init__(self, group_id: _Optional[str] = ..., aliases: _Optional[_Iterable[str]] = ..., devices: _Optional[_Iterable[str]] = ..., policy: _Optional[str] = ..., max_phase_s: _Optional[float] = ...) -> None: ...

class ListGroupsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListGroupsResponse(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[GroupInfo]
    def __init__(self, groups: _Optional[_Iterable[_Union[GroupInfo, _Mapping]]] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "name", "group_id", "owner", "weight", "quota_s", "used_s", "slices", "ttl_s", "expires_at", "created_at", "state", "resident", "evictions", "restores", "heartbeat_interval_s", "holder_timeout_s", "reattached", "queue_position", "driven_by", "reason", "expected_wait_s", "priority")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    QUOTA_S_FIELD_NUMBER: _ClassVar[int]
    USED_S_FIELD_NUMBER: _ClassVar[int]
    SLICES_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    RESTORES_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    HOLDER_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    REATTACHED_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    DRIVEN_BY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    name: str
    group_id: str
    owner: str
    weight: float
    quota_s: float
    used_s: float
    slices: int
    ttl_s: float
    expires_at: float
    created_at: float
    state: str
    resident: str
    evictions: int
    restores: int
    heartbeat_interval_s: float
    holder_timeout_s: float
    reattached: bool
    queue_position: int
    driven_by: str
    reason: str
    expected_wait_s: float
    priority: str
    def __init__(self, lease_id: _Optional[str] = ..., name: _Optional[str] = ..., group_id: _Optional[str] = ..., owner: _Optional[str] = ..., weight: _Optional[float] = ..., quota_s: _Optional[float] = ..., used_s: _Optional[float] = ..., slices: _Optional[int] = ..., ttl_s: _Optional[float] = ..., expires_at: _Optional[float] = ..., created_at: _Optional[float] = ..., state: _Optional[str] = ..., resident: _Optional[str] = ..., evictions: _Optional[int] = ..., restores: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ..., holder_timeout_s: _Optional[float] = ..., reattached: _Optional[bool] = ..., queue_position: _Optional[int] = ..., driven_by: _Optional[str] = ..., reason: _Optional[str] = ..., expected_wait_s: _Optional[float] = ..., priority: _Optional[str] = ...) -> None: ...

class CreateLeaseRequest(_message.Message):
    __slots__ = ("group_id", "name", "weight", "quota_s", "ttl_s", "on_behalf_of", "priority")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    QUOTA_S_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    ON_BEHALF_OF_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    name: str
    weight: float
    quota_s: float
    ttl_s: float
    on_behalf_of: str
    priority: str
    def __init__(self, group_id: _Optional[str] = ..., name: _Optional[str] = ..., weight: _Optional[float] = ..., quota_s: _Optional[float] = ..., ttl_s: _Optional[float] = ..., on_behalf_of: _Optional[str] = ..., priority: _Optional[str] = ...) -> None: ...

class GetLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ListLeasesRequest(_message.Message):
    __slots__ = ("group_id",)
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    def __init__(self, group_id: _Optional[str] = ...) -> None: ...

class ListLeasesResponse(_message.Message):
    __slots__ = ("leases",)
    LEASES_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[Lease]
    def __init__(self, leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ...) -> None: ...

class CloseLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class CloseLeaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("lease_id", "kind", "timeout_s", "gang", "gang_size")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    GANG_FIELD_NUMBER: _ClassVar[int]
    GANG_SIZE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    kind: str
    timeout_s: float
    gang: str
    gang_size: int
    def __init__(self, lease_id: _Optional[str] = ..., kind: _Optional[str] = ..., timeout_s: _Optional[float] = ..., gang: _Optional[str] = ..., gang_size: _Optional[int] = ...) -> None: ...

class Grant(_message.Message):
    __slots__ = ("slice_id", "lease_id", "group_id", "job", "kind", "waited_s", "must_restore", "granted_at", "heartbeat_interval_s", "switch_wait_s")
    SLICE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    WAITED_S_FIELD_NUMBER: _ClassVar[int]
    MUST_RESTORE_FIELD_NUMBER: _ClassVar[int]
    GRANTED_AT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    SWITCH_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    slice_id: str
    lease_id: str
    group_id: str
    job: str
    kind: str
    waited_s: float
    must_restore: bool
    granted_at: float
    heartbeat_interval_s: float
    switch_wait_s: float
    def __init__(self, slice_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., group_id: _Optional[str] = ..., job: _Optional[str] = ..., kind: _Optional[str] = ..., waited_s: _Optional[float] = ..., must_restore: _Optional[bool] = ..., granted_at: _Optional[float] = ..., heartbeat_interval_s: _Optional[float] = ..., switch_wait_s: _Optional[float] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("slice_id", "keep_resident", "restore_s", "outcome", "error")
    SLICE_ID_FIELD_NUMBER: _ClassVar[int]
    KEEP_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    RESTORE_S_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    slice_id: str
    keep_resident: bool
    restore_s: float
    outcome: str
    error: str
    def __init__(self, slice_id: _Optional[str] = ..., keep_resident: _Optional[bool] = ..., restore_s: _Optional[float] = ..., outcome: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("evict_requested", "switch_id", "run_s", "waiter_same_process")
    EVICT_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    SWITCH_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_S_FIELD_NUMBER: _ClassVar[int]
    WAITER_SAME_PROCESS_FIELD_NUMBER: _ClassVar[int]
    evict_requested: bool
    switch_id: int
    run_s: float
    waiter_same_process: bool
    def __init__(self, evict_requested: _Optional[bool] = ..., switch_id: _Optional[int] = ..., run_s: _Optional[float] = ..., waiter_same_process: _Optional[bool] = ...) -> None: ...

class ReportEvictedRequest(_message.Message):
    __slots__ = ("lease_id", "switch_id", "evict_s", "failed", "error")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SWITCH_ID_FIELD_NUMBER: _ClassVar[int]
    EVICT_S_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    switch_id: int
    evict_s: float
    failed: bool
    error: str
    def __init__(self, lease_id: _Optional[str] = ..., switch_id: _Optional[int] = ..., evict_s: _Optional[float] = ..., failed: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class ReportEvictedResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DropResidencyRequest(_message.Message):
    __slots__ = ("lease_id", "kept_on_host")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    KEPT_ON_HOST_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    kept_on_host: bool
    def __init__(self, lease_id: _Optional[str] = ..., kept_on_host: _Optional[bool] = ...) -> None: ...

class DropResidencyResponse(_message.Message):
    __slots__ = ("was_resident",)
    WAS_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    was_resident: bool
    def __init__(self, was_resident: _Optional[bool] = ...) -> None: ...

class DropStaleResidencyRequest(_message.Message):
    __slots__ = ("instance", "incarnation")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    instance: str
    incarnation: str
    def __init__(self, instance: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class DropStaleResidencyResponse(_message.Message):
    __slots__ = ("dropped", "revoked")
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    dropped: int
    revoked: int
    def __init__(self, dropped: _Optional[int] = ..., revoked: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("lease_ids", "slice_ids")
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    SLICE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    slice_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lease_ids: _Optional[_Iterable[str]] = ..., slice_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[LeaseEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[LeaseEvent, _Mapping]]] = ...) -> None: ...

class LeaseEvent(_message.Message):
    __slots__ = ("type", "lease_id", "group_id", "switch_id", "slice_id", "message", "waiter_same_process")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SWITCH_ID_FIELD_NUMBER: _ClassVar[int]
    SLICE_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    WAITER_SAME_PROCESS_FIELD_NUMBER: _ClassVar[int]
    type: str
    lease_id: str
    group_id: str
    switch_id: int
    slice_id: str
    message: str
    waiter_same_process: bool
    def __init__(self, type: _Optional[str] = ..., lease_id: _Optional[str] = ..., group_id: _Optional[str] = ..., switch_id: _Optional[int] = ..., slice_id: _Optional[str] = ..., message: _Optional[str] = ..., waiter_same_process: _Optional[bool] = ...) -> None: ...

class QueueEntry(_message.Message):
    __slots__ = ("job", "mine", "lease_ref", "kind", "since", "weight", "position", "reason", "expected_wait_s", "priority")
    JOB_FIELD_NUMBER: _ClassVar[int]
    MINE_FIELD_NUMBER: _ClassVar[int]
    LEASE_REF_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    job: str
    mine: bool
    lease_ref: str
    kind: str
    since: float
    weight: float
    position: int
    reason: str
    expected_wait_s: float
    priority: str
    def __init__(self, job: _Optional[str] = ..., mine: _Optional[bool] = ..., lease_ref: _Optional[str] = ..., kind: _Optional[str] = ..., since: _Optional[float] = ..., weight: _Optional[float] = ..., position: _Optional[int] = ..., reason: _Optional[str] = ..., expected_wait_s: _Optional[float] = ..., priority: _Optional[str] = ...) -> None: ...

class DutyCycle(_message.Message):
    __slots__ = ("group_id", "since", "until", "wall_s", "busy_s", "switch_s", "duty_cycle", "switch_share", "slices")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    UNTIL_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    SWITCH_S_FIELD_NUMBER: _ClassVar[int]
    DUTY_CYCLE_FIELD_NUMBER: _ClassVar[int]
    SWITCH_SHARE_FIELD_NUMBER: _ClassVar[int]
    SLICES_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    since: float
    until: float
    wall_s: float
    busy_s: float
    switch_s: float
    duty_cycle: float
    switch_share: float
    slices: int
    def __init__(self, group_id: _Optional[str] = ..., since: _Optional[float] = ..., until: _Optional[float] = ..., wall_s: _Optional[float] = ..., busy_s: _Optional[float] = ..., switch_s: _Optional[float] = ..., duty_cycle: _Optional[float] = ..., switch_share: _Optional[float] = ..., slices: _Optional[int] = ...) -> None: ...

class GroupStatus(_message.Message):
    __slots__ = ("group", "holder", "queue", "resident", "switching", "duty", "slices", "evictions", "restores", "revocations", "interactive_used_s", "interactive_cap_s", "interactive_window_s")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    SWITCHING_FIELD_NUMBER: _ClassVar[int]
    DUTY_FIELD_NUMBER: _ClassVar[int]
    SLICES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    RESTORES_FIELD_NUMBER: _ClassVar[int]
    REVOCATIONS_FIELD_NUMBER: _ClassVar[int]
    INTERACTIVE_USED_S_FIELD_NUMBER: _ClassVar[int]
    INTERACTIVE_CAP_S_FIELD_NUMBER: _ClassVar[int]
    INTERACTIVE_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    group: GroupInfo
    holder: QueueEntry
    queue: _containers.RepeatedCompositeFieldContainer[QueueEntry]
    resident: QueueEntry
    switching: bool
    duty: DutyCycle
    slices: int
    evictions: int
    restores: int
    revocations: int
    interactive_used_s: float
    interactive_cap_s: float
    interactive_window_s: float
    def __init__(self, group: _Optional[_Union[GroupInfo, _Mapping]] = ..., holder: _Optional[_Union[QueueEntry, _Mapping]] = ..., queue: _Optional[_Iterable[_Union[QueueEntry, _Mapping]]] = ..., resident: _Optional[_Union[QueueEntry, _Mapping]] = ..., switching: _Optional[bool] = ..., duty: _Optional[_Union[DutyCycle, _Mapping]] = ..., slices: _Optional[int] = ..., evictions: _Optional[int] = ..., restores: _Optional[int] = ..., revocations: _Optional[int] = ..., interactive_used_s: _Optional[float] = ..., interactive_cap_s: _Optional[float] = ..., interactive_window_s: _Optional[float] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ("group_id", "window_s")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    window_s: float
    def __init__(self, group_id: _Optional[str] = ..., window_s: _Optional[float] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("groups", "now")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    NOW_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[GroupStatus]
    now: float
    def __init__(self, groups: _Optional[_Iterable[_Union[GroupStatus, _Mapping]]] = ..., now: _Optional[float] = ...) -> None: ...

class SliceRecord(_message.Message):
    __slots__ = ("seq", "slice_id", "group_id", "job", "mine", "lease_ref", "kind", "requested_at", "granted_at", "released_at", "wait_s", "run_s", "switch_s", "restore_s", "evict_s", "must_restore", "outcome", "error", "priority", "gang", "gang_size")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SLICE_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    MINE_FIELD_NUMBER: _ClassVar[int]
    LEASE_REF_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_AT_FIELD_NUMBER: _ClassVar[int]
    GRANTED_AT_FIELD_NUMBER: _ClassVar[int]
    RELEASED_AT_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    RUN_S_FIELD_NUMBER: _ClassVar[int]
    SWITCH_S_FIELD_NUMBER: _ClassVar[int]
    RESTORE_S_FIELD_NUMBER: _ClassVar[int]
    EVICT_S_FIELD_NUMBER: _ClassVar[int]
    MUST_RESTORE_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    GANG_FIELD_NUMBER: _ClassVar[int]
    GANG_SIZE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    slice_id: str
    group_id: str
    job: str
    mine: bool
    lease_ref: str
    kind: str
    requested_at: float
    granted_at: float
    released_at: float
    wait_s: float
    run_s: float
    switch_s: float
    restore_s: float
    evict_s: float
    must_restore: bool
    outcome: str
    error: str
    priority: str
    gang: str
    gang_size: int
    def __init__(self, seq: _Optional[int] = ..., slice_id: _Optional[str] = ..., group_id: _Optional[str] = ..., job: _Optional[str] = ..., mine: _Optional[bool] = ..., lease_ref: _Optional[str] = ..., kind: _Optional[str] = ..., requested_at: _Optional[float] = ..., granted_at: _Optional[float] = ..., released_at: _Optional[float] = ..., wait_s: _Optional[float] = ..., run_s: _Optional[float] = ..., switch_s: _Optional[float] = ..., restore_s: _Optional[float] = ..., evict_s: _Optional[float] = ..., must_restore: _Optional[bool] = ..., outcome: _Optional[str] = ..., error: _Optional[str] = ..., priority: _Optional[str] = ..., gang: _Optional[str] = ..., gang_size: _Optional[int] = ...) -> None: ...

class GetTimelineRequest(_message.Message):
    __slots__ = ("group_id", "since", "since_seq", "limit")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    SINCE_SEQ_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    since: float
    since_seq: int
    limit: int
    def __init__(self, group_id: _Optional[str] = ..., since: _Optional[float] = ..., since_seq: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class GetTimelineResponse(_message.Message):
    __slots__ = ("records", "duty", "last_seq")
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    DUTY_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[SliceRecord]
    duty: DutyCycle
    last_seq: int
    def __init__(self, records: _Optional[_Iterable[_Union[SliceRecord, _Mapping]]] = ..., duty: _Optional[_Union[DutyCycle, _Mapping]] = ..., last_seq: _Optional[int] = ...) -> None: ...

class WatchTimelineRequest(_message.Message):
    __slots__ = ("group_id", "since_seq")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_SEQ_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    since_seq: int
    def __init__(self, group_id: _Optional[str] = ..., since_seq: _Optional[int] = ...) -> None: ...

class GetLaneRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLaneResponse(_message.Message):
    __slots__ = ("host", "port", "token")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    token: bytes
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ..., token: _Optional[bytes] = ...) -> None: ...

class LaneHello(_message.Message):
    __slots__ = ("token",)
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token: bytes
    def __init__(self, token: _Optional[bytes] = ...) -> None: ...

class LaneError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...
