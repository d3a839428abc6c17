"""Protobuf in and out, using the wire types that ship inside the `tinker` SDK.

Requests are decoded to numpy arrays and checked here, before they reach a kernel, so a bad datum gets a
4xx naming the problem and never touches a job's state. (numpy only: the gateway never imports torch.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import zstandard
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from openrl_lab.train.loss_spec import LossInputError, check_datum, resolve_config

MAX_BODY_BYTES = 512 * 1024 * 1024
_NP = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


class WireError(ValueError):
    """A request body that cannot be decoded or does not fit the model; the message names the problem."""


@dataclass
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float]
    forward_only: bool
    data: list[tuple[np.ndarray, dict[str, np.ndarray]]]


def parse_forward_backward(body: bytes, content_encoding: str | None) -> pb.ForwardBackwardRequest:
    if content_encoding == "zstd":
        try:
            body = zstandard.ZstdDecompressor().decompress(body, max_output_size=MAX_BODY_BYTES)
        except zstandard.ZstdError as e:
            raise WireError(f"forward_backward body is not valid zstd: {e}") from None
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as e:
        raise WireError(f"forward_backward body is not a valid ForwardBackwardRequest protobuf: {e}") from None
    if not msg.model_id:
        raise WireError("forward_backward request has no model_id (is the body a ForwardBackwardRequest protobuf?)")
    return msg


def _tensor(t: pb.Tensor, where: str) -> np.ndarray:
    dtype = _NP.get(t.dtype)
    if dtype is None:
        raise WireError(f"{where}: unsupported tensor dtype {pb.DType.Name(t.dtype)}")
    shape = tuple(t.shape)
    which = t.WhichOneof("encoding")
    try:
        if which == "sparse_csr":
            if len(shape) != 2:
                raise WireError(f"{where}: a sparse tensor needs a 2-D shape, got {list(shape)}")
            values = np.frombuffer(t.sparse_csr.values, dtype=dtype)
            crow = np.frombuffer(t.sparse_csr.crow_indices, dtype=np.int64)
            col = np.frombuffer(t.sparse_csr.col_indices, dtype=np.int64)
            dense = np.zeros(shape, dtype=dtype)
            for r in range(shape[0]):
                dense[r, col[crow[r]:crow[r + 1]]] = values[crow[r]:crow[r + 1]]
            return dense
        arr = np.frombuffer(t.dense, dtype=dtype)
        return arr.reshape(shape) if shape else arr
    except (ValueError, IndexError) as e:
        raise WireError(f"{where}: tensor bytes do not match dtype/shape {list(shape)}: {e}") from None


def decode_forward_backward(msg: pb.ForwardBackwardRequest, vocab_size: int, max_context: int) -> ForwardBackwardCall:
    """Checks every datum against the loss function and the model; raises WireError, DataError or LossInputError."""
    loss_fn = msg.loss_fn
    raw_config: dict[str, float] = dict(msg.loss_fn_config)
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "text":
            raise LossInputError(f"loss_fn_config key {key!r}: {loss_fn} takes numbers, got text {value.text!r}")
        raw_config[key] = value.number
    config = resolve_config(loss_fn, raw_config)
    if not msg.data:
        raise WireError("forward_backward got no data: send at least one Datum")
    data = []
    for i, datum in enumerate(msg.data):
        parts = []
        for chunk in datum.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise WireError(f"datum {i}: model_input chunk of type {kind!r} is not supported (text tokens only)")
            parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
        tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        inputs = {key: _tensor(t, f"datum {i}: loss_fn_inputs[{key!r}]").reshape(-1)
                  for key, t in datum.loss_fn_inputs.items()}
        data.append(check_datum(i, tokens, inputs, loss_fn, vocab_size, max_context))
    return ForwardBackwardCall(msg.model_id, msg.seq_id, loss_fn, config, msg.forward_only, data)


def encode_forward_backward_output(logprobs: list[np.ndarray], metrics: dict[str, float]) -> bytes:
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(logprobs))
    arrays = [np.asarray(a, dtype=np.float32).reshape(-1) for a in logprobs]
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([a.nbytes for a in arrays])
    field = record.fields["logprobs"]
    field.data = b"".join(a.tobytes() for a in arrays)
    field.offsets = offsets.tobytes()
    field.dtype = pb.DTYPE_FLOAT32
    for key, value in metrics.items():
        out.metrics[key] = float(value)
    return out.SerializeToString()


def encode_sample_response(sequences: list[tuple[list[int], list[float], str]],
                           prompt_logprobs: list[float] | None) -> bytes:
    out = pb.SampleResponse()
    for tokens, logprobs, stop_reason in sequences:
        out.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if stop_reason == "stop" else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(logprobs, dtype=np.float32).tobytes(),
        )
    if prompt_logprobs is not None:
        values = [math.nan if v is None else v for v in prompt_logprobs]
        out.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    return out.SerializeToString()
