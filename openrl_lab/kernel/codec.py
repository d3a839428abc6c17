"""What goes over the kernel protocol: JSON plus raw array bytes, never pickle (torch-free).

`encode(value)` -> (JSON bytes, blobs): None, bools, ints, floats (NaN and infinities included), strings,
lists and tuples (both come back as lists), dicts with string keys, dataclass instances (as dicts of their
fields: `api.py` turns them back into their types), bytes, and numpy arrays of the dtypes
in ARRAY_DTYPES. An array becomes {"__array__": i, "dtype": ..., "shape": [...]} and its bytes go to
blobs[i], little-endian in C order; bytes become {"__bytes__": i}. `decode` checks every reference: the
index, the dtype against the table, the shape against the blob's length, and the sizes against limits,
so a hostile peer gets a `CodecError` and nothing else.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import PurePath
from typing import Any

import numpy as np

ARRAY_DTYPES = frozenset(
    {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64"}
)
MAX_JSON_BYTES = 64 << 20
MAX_DEPTH = 64
_ARRAY, _BYTES = "__array__", "__bytes__"


class CodecError(ValueError):
    """A message that is not a well-formed kernel-protocol payload."""


def encode(value: Any) -> tuple[bytes, list[bytes]]:
    blobs: list[bytes] = []

    def walk(v: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise CodecError(f"nested deeper than {MAX_DEPTH}")
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, (int, np.integer)):
            return int(v)
        if isinstance(v, (float, np.floating)):
            return float(v)
        if isinstance(v, (list, tuple)):
            return [walk(x, depth + 1) for x in v]
        if isinstance(v, dict):
            if not all(isinstance(k, str) for k in v):
                raise CodecError("dict keys must be strings")
            return {k: walk(x, depth + 1) for k, x in v.items()}
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {f.name: walk(getattr(v, f.name), depth + 1) for f in dataclasses.fields(v)}
        if isinstance(v, np.ndarray):
            dtype = v.dtype.newbyteorder("<") if v.dtype.byteorder == ">" else v.dtype
            if dtype.name not in ARRAY_DTYPES:
                raise CodecError(f"arrays of {v.dtype} cannot be sent")
            blobs.append(np.ascontiguousarray(v, dtype=dtype).tobytes())
            return {_ARRAY: len(blobs) - 1, "dtype": dtype.name, "shape": list(v.shape)}
        if isinstance(v, PurePath):  # a path goes as its text (api.py turns it back into a Path)
            return str(v)
        if isinstance(v, (bytes, bytearray, memoryview)):
            blobs.append(bytes(v))
            return {_BYTES: len(blobs) - 1}
        raise CodecError(f"a {type(v).__name__} cannot be sent to or from a kernel")

    # allow_nan: logprobs carry NaN (the first prompt token) and metrics may be infinite; both ends are ours
    return json.dumps(walk(value, 0), allow_nan=True, separators=(",", ":")).encode(), blobs


def decode(data: bytes, blobs: list[bytes]) -> Any:
    if len(data) > MAX_JSON_BYTES:
        raise CodecError(f"{len(data)} bytes of JSON: at most {MAX_JSON_BYTES}")
    try:
        tree = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise CodecError(f"not JSON: {e}") from None
    used: set[int] = set()

    def blob(index: Any) -> bytes:
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(blobs) or index in used:
            raise CodecError(f"bad blob reference {index!r} ({len(blobs)} blobs)")
        used.add(index)
        return blobs[index]

    def walk(v: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise CodecError(f"nested deeper than {MAX_DEPTH}")
        if isinstance(v, list):
            return [walk(x, depth + 1) for x in v]
        if not isinstance(v, dict):
            return v
        if _ARRAY in v:
            return _array(v, blob(v[_ARRAY]))
        if _BYTES in v:
            return bytes(blob(v[_BYTES]))  # a streamed call's blobs are views into one buffer
        return {k: walk(x, depth + 1) for k, x in v.items()}

    return walk(tree, 0)


def _array(ref: dict, raw: bytes) -> np.ndarray:
    dtype, shape = ref.get("dtype"), ref.get("shape")
    if dtype not in ARRAY_DTYPES:
        raise CodecError(f"array dtype {dtype!r} is not one of {sorted(ARRAY_DTYPES)}")
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise CodecError(f"array shape {shape!r} is not a list of sizes")
    itemsize = np.dtype(dtype).itemsize
    if math.prod(shape) * itemsize != len(raw):
        raise CodecError(
            f"array of shape {shape} and dtype {dtype} needs {math.prod(shape) * itemsize} bytes, got {len(raw)}"
        )
    # A copy: the message's buffer is not ours to keep, and callers may write into the array.
    return np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape).astype(dtype, copy=True)
