"""The committed stubs in proto/ are exactly what scripts/gen_proto.py makes from the .proto files beside them."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_generated_stubs_match_protos(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), str(tmp_path)], check=True,
                   capture_output=True)
    made = sorted(p.name for p in tmp_path.iterdir() if "_pb2" in p.name)
    committed = sorted(p.name for p in (ROOT / "proto").iterdir() if "_pb2" in p.name)
    assert made == committed, "stub files differ: run python scripts/gen_proto.py"
    for name in made:
        fresh = (tmp_path / name).read_text()
        old = (ROOT / "proto" / name).read_text()
        assert fresh == old, f"proto/{name} is stale: run python scripts/gen_proto.py"
