"""Regenerate xlaserve_pb2.py / xlaserve_pb2_grpc.py from xlaserve.proto (needs grpcio-tools):

    python -m xlaserve.serving.grpc.regen

The generated modules import each other as `xlaserve.serving.grpc.xlaserve_pb2`, so protoc runs
from the repository root with the proto's package path.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> int:
    from grpc_tools import protoc

    root = Path(__file__).resolve().parents[3]
    proto = "xlaserve/serving/grpc/xlaserve.proto"
    return int(protoc.main(["grpc_tools.protoc", f"-I{root}", f"--python_out={root}",
                            f"--pyi_out={root}", f"--grpc_python_out={root}",
                            str(root / proto)]))


if __name__ == "__main__":
    sys.exit(main())
