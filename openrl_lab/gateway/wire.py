"""Protobuf in and out, using the wire types that ship inside the `tinker` SDK; and the JSON form of a
forward_backward that SDKs before 0.25 send (0.18 always, 0.24 unless the server asks for protobuf), decoded to
the same protobuf so that both forms take one path from there.

Requests are decoded to numpy arrays and checked here, before they reach a kernel, so a bad datum gets a
4xx naming the problem and never touches a job's state. (numpy only: the gateway never imports torch.)
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pydantic
import zstandard
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb
from tinker.types.topk_logprobs import MASK_LOGPROB

from openrl_lab.gateway.bodies import MAX_PROTO_BODY, BodyError, parse_json
from openrl_lab.kernel.api import Completion, TopK
from openrl_lab.train.loss_spec import LossInputError, check_datum, resolve_config

PROTO = "application/x-protobuf"  # the media type of protobuf bodies, both ways

# Bounds checked before anything is allocated: a small body may declare a huge decoded size (a zstd frame's
# content size, a sparse tensor's shape), and decoding it is what would cost memory and time.
MAX_DECODED_BYTES = MAX_PROTO_BODY
MAX_DATA_PER_REQUEST = 1024  # the SDK's default fwdbwd_max_chunk_len
MAX_VALUES_PER_REQUEST = 2**24  # tokens and loss_fn_inputs values of all datums together
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1  # token ids travel as int32
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
        hint = " (a JSON body needs Content-Type: application/json)" if body.lstrip()[:1] == b"{" else ""
        raise WireError(f"forward_backward body is not a valid ForwardBackwardRequest protobuf: {e}{hint}") from None
    return _checked(msg)


def _checked(msg: pb.ForwardBackwardRequest) -> pb.ForwardBackwardRequest:
    if not msg.model_id:
        raise WireError("forward_backward request has no model_id (is the body a ForwardBackwardRequest protobuf?)")
    if len(msg.data) > MAX_DATA_PER_REQUEST:
        raise WireError(f"forward_backward got {len(msg.data)} datums; send at most {MAX_DATA_PER_REQUEST} per request")
    return msg


# --- the JSON form (tinker's pydantic request types before 0.25, as `model_dump(mode="json")` writes them) ------
class _Json(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(protected_namespaces=())  # fields named model_*


class JsonTensor(_Json):
    data: list[float]  # int64 values are checked to be whole below
    dtype: Literal["int64", "float32"]
    shape: list[int] | None = None  # None: one dimension
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None


class JsonChunk(_Json):
    type: str = "encoded_text"
    tokens: list[int] | None = None  # encoded_text's; other chunk types (images) are refused when decoded


class JsonModelInput(_Json):
    chunks: list[JsonChunk]


class JsonDatum(_Json):
    model_input: JsonModelInput
    loss_fn_inputs: dict[str, JsonTensor]


class JsonForwardBackwardInput(_Json):
    data: list[JsonDatum] = pydantic.Field(max_length=MAX_DATA_PER_REQUEST)
    loss_fn: str
    loss_fn_config: dict[str, float] | None = None


class JsonForwardBackwardRequest(_Json):
    forward_backward_input: JsonForwardBackwardInput
    model_id: str
    seq_id: int | None = None


class JsonForwardRequest(_Json):
    """`POST /forward` (tinker before 0.25 without `fwd_via_fwdbwd`): a forward_backward without the backward."""

    forward_input: JsonForwardBackwardInput
    model_id: str
    seq_id: int | None = None


def parse_forward_backward_json(body: bytes, forward_only: bool) -> JsonForwardBackwardRequest | JsonForwardRequest:
    """A JSON forward_backward (`forward_only` False) or forward (True) body, checked for its form; its data are
    checked by `forward_backward_from_json`. Slow for large bodies: call it off the event loop."""
    what, model = ("forward", JsonForwardRequest) if forward_only else ("forward_backward", JsonForwardBackwardRequest)
    try:
        return model.model_validate(parse_json(body))
    except BodyError as e:
        raise WireError(f"{what} body: {e}") from None
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise WireError(f"{what} body is not a {model.__name__[4:]}: {where}: {first['msg']}{more}") from None


def forward_backward_from_json(req: JsonForwardBackwardRequest | JsonForwardRequest) -> pb.ForwardBackwardRequest:
    """The protobuf the SDK would have sent for it (then decoded like any other)."""
    forward_only = isinstance(req, JsonForwardRequest)
    given = req.forward_input if isinstance(req, JsonForwardRequest) else req.forward_backward_input
    msg = pb.ForwardBackwardRequest(
        model_id=req.model_id, seq_id=req.seq_id or 0, loss_fn=given.loss_fn, forward_only=forward_only
    )
    msg.loss_fn_config.update(given.loss_fn_config or {})
    for i, datum in enumerate(given.data):
        out = msg.data.add()
        for chunk in datum.model_input.chunks:
            if chunk.type != "encoded_text" or chunk.tokens is None:
                raise WireError(
                    f"datum {i}: model_input chunk of type {chunk.type!r} is not supported (text tokens only)"
                )
            ids = np.asarray(chunk.tokens, dtype=np.int64)  # int64 already (parse_json)
            if ids.size and (ids.min() < INT32_MIN or ids.max() > INT32_MAX):
                raise WireError(f"datum {i}: model_input holds a token id outside int32")
            out.model_input.add().encoded_text.tokens = ids.astype(np.int32).tobytes()
        for key, t in datum.loss_fn_inputs.items():
            out.loss_fn_inputs[key].CopyFrom(_json_tensor(t, f"datum {i}: loss_fn_inputs[{key!r}]"))
    return _checked(msg)


def _json_tensor(t: JsonTensor, where: str) -> pb.Tensor:
    values = np.asarray(t.data, dtype=np.float64)
    if t.dtype == "int64":
        if not np.all(values == np.round(values)) or (values.size and np.abs(values).max() >= 2**53):
            raise WireError(f"{where}: dtype int64 holds a value that is not a whole number (or not exactly one)")
        data, dtype = np.asarray(t.data, dtype=np.int64).tobytes(), pb.DTYPE_INT64
    else:
        data, dtype = values.astype(np.float32).tobytes(), pb.DTYPE_FLOAT32
    shape = t.shape if t.shape is not None else [len(t.data)]
    if t.sparse_crow_indices is None and t.sparse_col_indices is None:
        return pb.Tensor(dtype=dtype, shape=shape, dense=data)
    if t.sparse_crow_indices is None or t.sparse_col_indices is None:
        raise WireError(f"{where}: a sparse tensor needs both sparse_crow_indices and sparse_col_indices")
    csr = pb.SparseCsr(
        values=data,
        crow_indices=np.asarray(t.sparse_crow_indices, dtype=np.int64).tobytes(),
        col_indices=np.asarray(t.sparse_col_indices, dtype=np.int64).tobytes(),
    )
    return pb.Tensor(dtype=dtype, shape=shape, sparse_csr=csr)


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


# --- results as JSON, for a client that does not accept protobuf for them -------------------------------------
def result_as_json(kind: str, body: bytes) -> bytes:
    """A stored protobuf result (a "sample" future's SampleResponse, else a ForwardBackwardOutput) as the JSON that
    the SDK's pydantic types read: for a retrieve_future without `Accept: application/x-protobuf` (tinker 0.18
    decodes only SampleResponse from protobuf, and says so by what it accepts)."""
    if kind == "sample":
        msg = pb.SampleResponse.FromString(body)
        value: dict = {
            "type": "sample",
            "sequences": [
                {
                    "stop_reason": "stop" if s.stop_reason == pb.STOP_REASON_STOP else "length",
                    "tokens": np.frombuffer(s.tokens, dtype=np.int32).tolist(),
                    "logprobs": np.frombuffer(s.logprobs, dtype=np.float32).tolist(),
                    **(
                        {"topk_logprobs": _topk_lists(s.topk_sampled_logprobs)}
                        if s.HasField("topk_sampled_logprobs")
                        else {}
                    ),
                }
                for s in msg.sequences
            ],
        }
        if msg.HasField("prompt_logprobs"):
            value["prompt_logprobs"] = [
                None if math.isnan(v) else v for v in np.frombuffer(msg.prompt_logprobs, dtype=np.float32).tolist()
            ]
        if msg.HasField("topk_prompt_logprobs"):
            value["topk_prompt_logprobs"] = _topk_lists(msg.topk_prompt_logprobs)
    else:
        out = pb.ForwardBackwardOutput.FromString(body)
        outputs: list[dict] = []
        for record in out.loss_fn_outputs:  # columns of arrays, one row per datum, split at byte offsets
            columns = {}
            for name, field in record.fields.items():
                values = np.frombuffer(field.data, dtype=_NP[field.dtype])
                offsets = np.frombuffer(field.offsets, dtype=np.int64) // values.itemsize
                dtype = "float32" if values.dtype == np.float32 else "int64"
                columns[name] = [
                    {"data": values[a:b].tolist(), "dtype": dtype, "shape": [int(b - a)]}
                    for a, b in itertools.pairwise(offsets)
                ]
            outputs += [{name: rows[i] for name, rows in columns.items()} for i in range(record.num_datums)]
        value = {
            "loss_fn_output_type": out.loss_fn_output_type,
            "loss_fn_outputs": outputs,
            "metrics": dict(out.metrics),
        }
    return json.dumps(value).encode()


def _topk_lists(msg) -> list[list[list[float]] | None]:
    """(N, k) matrices as the JSON form: per position a list of [token_id, logprob], the empty cells left out."""
    ids = np.frombuffer(msg.token_ids, dtype=np.int32).reshape(msg.length, msg.k)
    lps = np.frombuffer(msg.logprobs, dtype=np.float32).reshape(msg.length, msg.k)
    rows: list = []
    for row_ids, row_lps in zip(ids.tolist(), lps.tolist()):
        cells = [[t, lp] for t, lp in zip(row_ids, row_lps) if lp != MASK_LOGPROB]
        rows.append(cells or None)
    return rows
