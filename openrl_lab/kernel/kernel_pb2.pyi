from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Call(_message.Message):
    __slots__ = ("op", "args", "blobs")
    OP_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    BLOBS_FIELD_NUMBER: _ClassVar[int]
    op: str
    args: bytes
    blobs: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, op: _Optional[str] = ..., args: _Optional[bytes] = ..., blobs: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Reply(_message.Message):
    __slots__ = ("status", "result", "blobs")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    BLOBS_FIELD_NUMBER: _ClassVar[int]
    status: str
    result: bytes
    blobs: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, status: _Optional[str] = ..., result: _Optional[bytes] = ..., blobs: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Header(_message.Message):
    __slots__ = ("op", "status", "json", "blob_sizes")
    OP_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    BLOB_SIZES_FIELD_NUMBER: _ClassVar[int]
    op: str
    status: str
    json: bytes
    blob_sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, op: _Optional[str] = ..., status: _Optional[str] = ..., json: _Optional[bytes] = ..., blob_sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class Piece(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: Header
    data: bytes
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("token", "name", "group", "device", "address", "key", "incarnation", "tls", "host")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    token: str
    name: str
    group: str
    device: str
    address: str
    key: str
    incarnation: str
    tls: bool
    host: str
    def __init__(self, token: _Optional[str] = ..., name: _Optional[str] = ..., group: _Optional[str] = ..., device: _Optional[str] = ..., address: _Optional[str] = ..., key: _Optional[str] = ..., incarnation: _Optional[str] = ..., tls: _Optional[bool] = ..., host: _Optional[str] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("name", "orchestrator_key", "group")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ORCHESTRATOR_KEY_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    name: str
    orchestrator_key: str
    group: str
    def __init__(self, name: _Optional[str] = ..., orchestrator_key: _Optional[str] = ..., group: _Optional[str] = ...) -> None: ...
