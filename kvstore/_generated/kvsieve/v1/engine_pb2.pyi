from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class RunProgramRequest(_message.Message):
    __slots__ = ("source", "args", "keep", "namespace")
    class ArgsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    source: str
    args: _containers.ScalarMap[str, str]
    keep: bool
    namespace: str
    def __init__(self, source: _Optional[str] = ..., args: _Optional[_Mapping[str, str]] = ..., keep: _Optional[bool] = ..., namespace: _Optional[str] = ...) -> None: ...

class ProgramEvent(_message.Message):
    __slots__ = ("kind", "name", "value_json", "elapsed_s")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_JSON_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    kind: str
    name: str
    value_json: str
    elapsed_s: float
    def __init__(self, kind: _Optional[str] = ..., name: _Optional[str] = ..., value_json: _Optional[str] = ..., elapsed_s: _Optional[float] = ...) -> None: ...
