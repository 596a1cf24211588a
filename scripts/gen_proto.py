#!/usr/bin/env python3
"""Regenerate the committed gRPC stubs in proto/ from the .proto files beside them.

The one way stubs are made; tests/test_proto_drift.py fails when the committed
files differ from what this script produces. The stubs import each other as
``timeslice.proto`` (the folder proto/ installs as that package, see
pyproject.toml): protoc reads the .proto files in place, with proto/ mapped onto
the import path timeslice/proto (``-Itimeslice/proto=proto``). protoc always
writes its output under that import path, so it writes into a temporary folder
and the stubs are moved from there into OUTDIR. Usage: python scripts/gen_proto.py [OUTDIR]
"""
from __future__ import annotations

import pathlib
import shutil
import sys
import tempfile

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE = ROOT / "proto"
IMPORT_PATH = pathlib.PurePosixPath("timeslice") / "proto"


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Compile every proto/*.proto into out_dir (flat, like proto/); returns the files made."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for proto in sorted(SOURCE.glob("*.proto")):
            rc = protoc.main(["grpc_tools.protoc", f"-I{IMPORT_PATH}={SOURCE}", f"--python_out={tmp}",
                              f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", str(IMPORT_PATH / proto.name)])
            if rc != 0:
                raise SystemExit(f"protoc failed on {proto.name} (rc={rc})")
        for made in sorted(pathlib.Path(tmp, IMPORT_PATH).glob("*_pb2*")):
            shutil.move(made, out_dir / made.name)
    return sorted(p for p in out_dir.iterdir() if "_pb2" in p.name)


if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else SOURCE
    for path in generate(out):
        print(path)
