#!/usr/bin/env python3
"""Regenerate the committed gRPC stubs in proto/tsproto from the .proto files.

The one way stubs are made; tests/test_proto_drift.py fails when the committed
files differ from what this script produces. Usage: python scripts/gen_proto.py [OUTDIR]
"""
from __future__ import annotations

import pathlib
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Compile every proto/tsproto/*.proto into out_dir/tsproto; returns the files made."""
    protos = sorted((PROTO_ROOT / "tsproto").glob("*.proto"))
    (out_dir / "tsproto").mkdir(parents=True, exist_ok=True)
    for proto in protos:
        rc = protoc.main([
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(proto.relative_to(PROTO_ROOT)),
        ])
        if rc != 0:
            raise SystemExit(f"protoc failed on {proto} (rc={rc})")
    return sorted(p for p in (out_dir / "tsproto").iterdir() if "_pb2" in p.name)


if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT
    for path in generate(out):
        print(path)
