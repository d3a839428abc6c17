"""Regenerates the gRPC modules (`*_pb2.py`, `*_pb2_grpc.py`) and the messages' type stubs (`*_pb2.pyi`, for
pyright) from every `.proto` file in the package:
`orchestrator/orchestrator.proto` and `kernel/kernel.proto`.

    .venv/bin/python -m openrl_lab.tools.regen_protos

Needs `grpcio-tools` (a development tool only; the generated modules need `grpcio` and `protobuf` at
runtime). Run from anywhere: paths are resolved from this file, so the generated imports are package
imports (`from openrl_lab.orchestrator import orchestrator_pb2`).
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> int:
    from grpc_tools import protoc  # pyright: ignore[reportMissingImports] - an optional extra

    package = Path(__file__).resolve().parents[1]
    root = package.parent  # the repository root: the directory that holds `openrl_lab/`
    for proto in sorted(package.rglob("*.proto")):
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{root}",
                f"--python_out={root}",
                f"--pyi_out={root}",
                f"--grpc_python_out={root}",
                str(proto.relative_to(root)),
            ]
        )
        if rc != 0:
            print(f"protoc failed on {proto} with status {rc}", file=sys.stderr)
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
