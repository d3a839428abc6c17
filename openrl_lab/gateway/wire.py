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
from tinker.types.topk_logprobs import MASK_LOGPROB

from openrl_lab.gateway.bodies import MAX_PROTO_BODY
from openrl_lab.kernel.api import Completion, TopK
from openrl_lab.train.loss_spec import LossInputError, check_datum, resolve_config

# Bounds checked before anything is allocated: a small body may declare a huge decoded size (a zstd frame's
# content size, a sparse tensor's shape), and decoding it is what would cost memory and time.
MAX_DECODED_BYTES = MAX_PROTO_BODY
MAX_DATA_PER_REQUEST = 1024  # the SDK's default fwdbwd_max_chunk_len
MAX_VALUES_PER_REQUEST = 2**24  # tokens and loss_fn_inputs values of all datums together
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
    """The request's protobuf (zstd-decoded if so sent). Slow for large bodies: call it off the event loop."""
    if content_encoding == "zstd":
        body = _unzstd(body)
    elif content_encoding not in (None, "identity"):
        raise WireError(f"Content-Encoding {content_encoding!r} is not supported: send zstd or no encoding")
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as e:
        raise WireError(f"forward_backward body is not a valid ForwardBackwardRequest protobuf: {e}") from None
    if not msg.model_id:
        raise WireError("forward_backward request has no model_id (is the body a ForwardBackwardRequest protobuf?)")
    if len(msg.data) > MAX_DATA_PER_REQUEST:
        raise WireError(f"forward_backward got {len(msg.data)} datums; send at most {MAX_DATA_PER_REQUEST} per request")
    return msg


def _unzstd(body: bytes) -> bytes:
    # The declared content size is checked first; the stream reader never allocates more than the cap
    # (ZstdDecompressor.decompress ignores max_output_size when a frame declares its size).
    try:
        declared = zstandard.frame_content_size(body)
        if declared > MAX_DECODED_BYTES:
            raise WireError(
                f"forward_backward body declares {declared} bytes once decompressed; at most "
                f"{MAX_DECODED_BYTES} are accepted"
            )
        with zstandard.ZstdDecompressor().stream_reader(body) as reader:
            out = reader.read(MAX_DECODED_BYTES + 1)
    except zstandard.ZstdError as e:
        raise WireError(f"forward_backward body is not valid zstd: {e}") from None
    if len(out) > MAX_DECODED_BYTES:
        raise WireError(f"forward_backward body decompresses to more than {MAX_DECODED_BYTES} bytes")
    return out


class _Budget:
    """Values a request may still decode (MAX_VALUES_PER_REQUEST), each tensor at most the model's context."""

    def __init__(self, max_context: int):
        self.left = MAX_VALUES_PER_REQUEST
        self.max_context = max_context

    def take(self, n: int, where: str) -> None:
        if n > self.max_context:
            raise WireError(f"{where}: {n} values, more than the model's context of {self.max_context} tokens")
        if n > self.left:
            raise WireError(f"{where}: the request holds more than {MAX_VALUES_PER_REQUEST} values in all")
        self.left -= n


def _tensor(t: pb.Tensor, where: str, budget: _Budget) -> np.ndarray:
    dtype = _NP.get(t.dtype)
    if dtype is None:
        name = pb.DType.Name(t.dtype) if t.dtype in pb.DType.values() else f"number {t.dtype}"
        raise WireError(f"{where}: unsupported tensor dtype {name} (float32, int64 or int32)")
    shape = tuple(t.shape)
    if any(d < 0 for d in shape):
        raise WireError(f"{where}: negative dimension in shape {list(shape)}")
    budget.take(math.prod(shape), where)
    try:
        if t.WhichOneof("encoding") == "sparse_csr":
            return _sparse(t.sparse_csr, shape, dtype, where)
        arr = np.frombuffer(t.dense, dtype=dtype)
        return arr.reshape(shape) if shape else arr
    except ValueError as e:
        raise WireError(f"{where}: tensor bytes do not match dtype/shape {list(shape)}: {e}") from None


def _sparse(csr: pb.SparseCsr, shape: tuple[int, ...], dtype, where: str) -> np.ndarray:
    if len(shape) != 2:
        raise WireError(f"{where}: a sparse tensor needs a 2-D shape, got {list(shape)}")
    values = np.frombuffer(csr.values, dtype=dtype)
    crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
    col = np.frombuffer(csr.col_indices, dtype=np.int64)
    counts = np.diff(crow)
    if not (
        len(crow) == shape[0] + 1
        and len(col) == len(values)
        and crow[0] == 0
        and crow[-1] == len(values)
        and (counts >= 0).all()
    ):
        raise WireError(
            f"{where}: sparse crow_indices/col_indices do not describe {len(values)} values in shape {list(shape)}"
        )
    if len(col) and (col.min() < 0 or col.max() >= shape[1]):
        raise WireError(f"{where}: sparse col_indices outside [0, {shape[1]})")
    dense = np.zeros(shape, dtype=dtype)
    dense[np.repeat(np.arange(shape[0]), counts), col] = values
    return dense


def _tokens(chunks, where: str, budget: _Budget) -> np.ndarray:
    parts = []
    for chunk in chunks:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise WireError(f"{where}: model_input chunk of type {kind!r} is not supported (text tokens only)")
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise WireError(f"{where}: encoded_text.tokens has {len(raw)} bytes, not a whole number of int32 ids")
        parts.append(np.frombuffer(raw, dtype=np.int32))
    tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    budget.take(tokens.size, f"{where}: model_input")
    return tokens


def decode_forward_backward(msg: pb.ForwardBackwardRequest, vocab_size: int, max_context: int) -> ForwardBackwardCall:
    """Checks every datum against the loss function and the model; raises WireError, DataError or LossInputError.
    Slow for large requests: call it off the event loop."""
    loss_fn = msg.loss_fn
    raw_config: dict[str, float] = dict(msg.loss_fn_config)
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "text":
            raise LossInputError(f"loss_fn_config key {key!r}: {loss_fn} takes numbers, got text {value.text!r}")
        raw_config[key] = value.number
    bad = [key for key, value in raw_config.items() if not math.isfinite(value)]
    if bad:
        raise LossInputError(f"loss_fn_config {', '.join(map(repr, bad))}: values must be finite numbers")
    config = resolve_config(loss_fn, raw_config)
    if not msg.data:
        raise WireError("forward_backward got no data: send at least one Datum")
    budget = _Budget(max_context)
    data = []
    for i, datum in enumerate(msg.data):
        tokens = _tokens(datum.model_input, f"datum {i}", budget)
        inputs = {
            key: _tensor(t, f"datum {i}: loss_fn_inputs[{key!r}]", budget).reshape(-1)
            for key, t in datum.loss_fn_inputs.items()
        }
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


def blank_topk_rows(topk: TopK, rows: int) -> TopK:
    """The top-k matrices with their first `rows` rows emptied (positions not scored)."""
    ids, lps = topk.token_ids.copy(), topk.logprobs.copy()
    ids[:rows], lps[:rows] = 0, MASK_LOGPROB  # the SDK's empty cell
    return TopK(ids, lps)


def _set_topk(msg, topk: TopK) -> None:
    """A TopkLogprobs message from (N, k) matrices: row-major int32 ids and float32 logprobs, k, length N."""
    ids = np.asarray(topk.token_ids, dtype=np.int32)
    msg.token_ids = ids.tobytes()
    msg.logprobs = np.asarray(topk.logprobs, dtype=np.float32).tobytes()
    msg.length, msg.k = ids.shape


def encode_sample_response(
    sequences: list[Completion],
    prompt_logprobs: list[float] | None,
    topk_prompt_logprobs: TopK | None = None,
) -> bytes:
    out = pb.SampleResponse()
    for c in sequences:
        seq = out.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if c.stop_reason == "stop" else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(c.tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(c.logprobs, dtype=np.float32).tobytes(),
        )
        if c.topk is not None:
            _set_topk(seq.topk_sampled_logprobs, c.topk)
    if prompt_logprobs is not None:
        values = [math.nan if v is None else v for v in prompt_logprobs]
        out.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    if topk_prompt_logprobs is not None:
        _set_topk(out.topk_prompt_logprobs, topk_prompt_logprobs)
    return out.SerializeToString()
