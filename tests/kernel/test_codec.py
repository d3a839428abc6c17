"""The kernel protocol's payloads: JSON plus raw array bytes, round trips exact, nothing but data accepted."""

from __future__ import annotations

import math

import numpy as np
import pytest

from openrl_lab.kernel.codec import ARRAY_DTYPES, CodecError, decode, encode


def test_round_trip_of_what_the_kernel_sends_and_receives():
    rng = np.random.default_rng(0)
    arrays = {dtype: (rng.standard_normal((3, 4)) * 100).astype(dtype) for dtype in sorted(ARRAY_DTYPES)}
    value = {
        "data": [(np.arange(5, dtype=np.int64), {"weights": np.ones(5, np.float32)})],
        "arrays": arrays,
        "empty": np.zeros((0, 7), np.float16),
        "scalar": np.float32(1.5),
        "count": np.int64(7),
        "nan": math.nan,
        "inf": -math.inf,
        "text": "é✓",
        "raw": b"\x00\xff",
        "none": None,
        "flag": True,
        "big_endian": np.arange(3, dtype=">i4"),
    }
    got = decode(*encode(value))
    assert got["data"][0][0].dtype == np.int64 and got["data"][0][0].tolist() == [0, 1, 2, 3, 4]
    for dtype, a in arrays.items():
        assert got["arrays"][dtype].dtype == np.dtype(dtype) and np.array_equal(got["arrays"][dtype], a)
    assert got["empty"].shape == (0, 7)
    assert got["scalar"] == 1.5 and got["count"] == 7 and math.isnan(got["nan"]) and got["inf"] == -math.inf
    assert got["text"] == "é✓" and got["raw"] == b"\x00\xff" and got["none"] is None and got["flag"] is True
    assert got["big_endian"].tolist() == [0, 1, 2]
    got["data"][0][0][0] = 99  # decoded arrays are the receiver's own, writable


@pytest.mark.parametrize(
    "value, words",
    [
        (object(), "a object cannot be sent"),
        ({1: "x"}, "keys must be strings"),
        (np.array(["a"]), "arrays of <U1 cannot be sent"),
        (np.array([1 + 2j]), "arrays of complex128"),
    ],
)
def test_encode_sends_data_only(value, words):
    with pytest.raises(CodecError, match=words):
        encode(value)


def test_decode_refuses_what_does_not_add_up():
    with pytest.raises(CodecError, match="bad blob reference"):
        decode(b'[{"__bytes__": 0}, {"__bytes__": 0}]', [b"x"])  # one blob used twice
    with pytest.raises(CodecError, match="not a list of sizes"):
        decode(b'{"__array__": 0, "dtype": "int8", "shape": [-1]}', [b""])
    with pytest.raises(CodecError, match="nested deeper"):
        decode(b"[" * 100 + b"]" * 100, [])
