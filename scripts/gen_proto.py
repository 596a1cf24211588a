#!/usr/bin/env python3
"""Regenerate the committed gRPC stubs in proto/tsproto from the .proto files.

The one way stubs are made; tests/test_proto_drift.py fails when the committed
files differ from what this script produces. The stubs import each other as
``timeslice.proto`` (the folder proto/tsproto installs as that package, see
pyproject.toml), so the .proto files are compiled from a staging tree laid out
as timeslice/proto/. Usage: python scripts/gen_proto.py [OUTDIR]
"""
from __future__ import annotations

import pathlib
import shutil
import sys
import tempfile

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE = ROOT / "proto" / "tsproto"
PACKAGE = pathlib.Path("timeslice") / "proto"


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Compile every proto/tsproto/*.proto into out_dir/tsproto; returns the files made."""
    target = out_dir / "tsproto"
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        stage = pathlib.Path(tmp)
        (stage / PACKAGE).mkdir(parents=True)
        for proto in sorted(SOURCE.glob("*.proto")):
            shutil.copy(proto, stage / PACKAGE / proto.name)
        for proto in sorted((stage / PACKAGE).glob("*.proto")):
            rc = protoc.main(["grpc_tools.protoc", f"-I{stage}", f"--python_out={stage}", f"--pyi_out={stage}",
                              f"--grpc_python_out={stage}", str(proto.relative_to(stage))])
            if rc != 0:
                raise SystemExit(f"protoc failed on {proto.name} (rc={rc})")
        for made in sorted((stage / PACKAGE).glob("*_pb2*")):
            shutil.copy(made, target / made.name)
    return sorted(p for p in target.iterdir() if "_pb2" in p.name)


if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "proto"
    for path in generate(out):
        print(path)
