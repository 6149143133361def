"""Generate the Python stubs of proto/kvsieve/v1/*.proto into kvstore/_generated.

Run from anywhere: `python proto/generate.py` (needs grpcio-tools, pinned in the
`dev` extra so that the output is reproducible). `--check` regenerates into a
temporary directory and exits 1 if the committed stubs differ.
"""

from __future__ import annotations

import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "kvstore" / "_generated"
PACKAGE = "kvstore._generated"


def generate(out_dir: Path) -> list[Path]:
    """Run protoc into `out_dir`; returns the files written, relative to it."""
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *protos]  # fmt: skip
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = []
    for path in sorted(out_dir.rglob("*.py*")):
        text = path.read_text()
        # protoc writes absolute imports from the proto root; ours live under kvstore/_generated.
        text = text.replace("from kvsieve.v1 import", f"from {PACKAGE}.kvsieve.v1 import")
        path.write_text(text)
        written.append(path.relative_to(out_dir))
    for folder in [out_dir, *(p for p in out_dir.rglob("*") if p.is_dir())]:
        (folder / "__init__.py").touch()
        written.append((folder / "__init__.py").relative_to(out_dir))
    return sorted(set(written))


def main() -> int:
    if "--check" in sys.argv:
        with tempfile.TemporaryDirectory() as tmp:
            files = generate(Path(tmp))
            stale = [str(f) for f in files if not (OUT_DIR / f).exists()
                     or not filecmp.cmp(Path(tmp) / f, OUT_DIR / f, shallow=False)]  # fmt: skip
        if stale:
            print(f"stale generated stubs: {stale}; run python proto/generate.py", file=sys.stderr)
            return 1
        return 0
    shutil.rmtree(OUT_DIR, ignore_errors=True)
    OUT_DIR.mkdir(parents=True)
    for f in generate(OUT_DIR):
        print(f"wrote kvstore/_generated/{f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
