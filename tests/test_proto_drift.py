"""The committed stubs in proto/tsproto are exactly what scripts/gen_proto.py makes."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_generated_stubs_match_protos(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), str(tmp_path)], check=True,
                   capture_output=True)
    made = sorted(p.name for p in (tmp_path / "tsproto").iterdir() if "_pb2" in p.name)
    committed = sorted(p.name for p in (ROOT / "proto" / "tsproto").iterdir() if "_pb2" in p.name)
    assert made == committed, "stub files differ: run python scripts/gen_proto.py"
    for name in made:
        fresh = (tmp_path / "tsproto" / name).read_text()
        old = (ROOT / "proto" / "tsproto" / name).read_text()
        assert fresh == old, f"proto/tsproto/{name} is stale: run python scripts/gen_proto.py"
