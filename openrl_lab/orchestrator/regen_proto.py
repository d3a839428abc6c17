"""Regenerates `orchestrator_pb2.py` and `orchestrator_pb2_grpc.py` from `orchestrator.proto`.

    .venv/bin/python -m openrl_lab.orchestrator.regen_proto

Needs `grpcio-tools` (a development tool only; the generated modules need `grpcio` and `protobuf` at
runtime). Run from anywhere: paths are resolved from this file, so the generated imports are package
imports (`from openrl_lab.orchestrator import orchestrator_pb2`).
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> int:
    from grpc_tools import protoc

    here = Path(__file__).resolve().parent
    root = here.parents[1]  # the repository root: the directory that holds `openrl_lab/`
    proto = here / "orchestrator.proto"
    rc = protoc.main(["grpc_tools.protoc", f"-I{root}", f"--python_out={root}", f"--grpc_python_out={root}",
                      str(proto.relative_to(root))])
    if rc != 0:
        print(f"protoc failed with status {rc}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
