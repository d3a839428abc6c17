"""The sandbox's wire format: the subset of SandboxFusion's `run_code` API that SandboxFusion clients send (the
tinker-cookbook's `SandboxFusionClient` among them), so they run unchanged against `<lab>/sandbox/run_code`,
plus a batch of them in one request (`run_batch`, what a notebook sends for a whole RL group).

    request   {code, language="python", run_timeout=10, compile_timeout (accepted, unused: nothing is compiled),
               memory_limit_MB=-1 (the lab's default), stdin="", files: {name: base64}, fetch_files: [name]}
    response  {status: Success | Failed | SandboxError, message, compile_result: null,
               run_result: {status: Finished | TimeLimitExceeded | Error, execution_time, return_code, stdout,
               stderr}, files: {name: base64}}

`Success` is a program that ran to its end with return code 0; `Failed` one that did not (a return code, a
signal, the time limit); `SandboxError` the sandbox itself failing (the host lacks what it needs, say), with
the reason in `message`. Fields SandboxFusion has and this lab does not use are accepted and ignored.
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_CODE_CHARS = 1 << 20  # a program of 1 MiB is not a model's answer any more
MAX_FILES = 64
MAX_BATCH = 512  # a batch is an RL group (or a few): hundreds, not thousands


class RunCodeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    code: Annotated[str, Field(max_length=MAX_CODE_CHARS)]
    language: str = "python"
    run_timeout: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 10.0
    compile_timeout: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 10.0
    memory_limit_MB: int = -1  # noqa: N815 - SandboxFusion's name
    stdin: str | None = ""
    files: Annotated[dict[str, str | None], Field(max_length=MAX_FILES)] = {}
    fetch_files: Annotated[list[str], Field(max_length=MAX_FILES)] = []

    @field_validator("files")
    @classmethod
    def _base64(cls, files: dict[str, str | None]) -> dict[str, str | None]:
        for name, data in files.items():
            if data is None:
                continue
            try:
                base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError) as e:
                raise ValueError(f"files[{name!r}] is not base64 ({e})") from None
        return files

    def decoded_files(self) -> dict[str, bytes]:
        return {k: base64.b64decode(v) if v else b"" for k, v in self.files.items()}


class CommandRunResult(BaseModel):
    status: Literal["Finished", "TimeLimitExceeded", "Error"]
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None
    truncated: bool = False  # this lab's: stdout or stderr was cut at the output limit


class RunCodeResponse(BaseModel):
    status: Literal["Success", "Failed", "SandboxError"]
    message: str = ""
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = {}


class RunBatchRequest(BaseModel):
    """Many programs in one request; answered in order, run at once within the user's share of the pool."""

    requests: Annotated[list[RunCodeRequest], Field(min_length=1, max_length=MAX_BATCH)]


class RunBatchResponse(BaseModel):
    responses: list[RunCodeResponse]
