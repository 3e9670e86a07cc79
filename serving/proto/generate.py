"""Regenerate the Python stubs beside this file from `pallasite/v1/generation.proto`.

    python -m pallasite.serving.proto.generate    (needs grpcio-tools)

The stubs are committed, so users need no protoc. Two edits make them import on older runtimes
than the generator's (the GPU machine runs another grpcio and protobuf than development does):
the version gates are dropped (protobuf's `ValidateProtobufRuntimeVersion`, which refuses any
runtime older than the generator, and grpc's `GRPC_GENERATED_VERSION` check), and imports are
made relative, since the proto package `pallasite.v1` is no Python package here. What stays
only calls APIs present since protobuf 3.20 and grpcio 1.63: the serialized file descriptor is
added to the default pool and the message classes are built from it.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
PROTO = "pallasite/v1/generation.proto"
MODULE = "pallasite.serving.proto.generation_pb2"


def _sub(pattern: str, repl: str, text: str, flags=0) -> str:
    """re.sub that insists on a match, so a changed generator fails here, not at import."""
    out, n = re.subn(pattern, repl, text, flags=flags)
    if n == 0:
        raise RuntimeError(f"generator output changed: no match for {pattern!r}")
    return out


NOTE = "# Version gate removed by serving/proto/generate.py: the stubs import on older runtimes.\n"


def fix_pb2(text: str) -> str:
    text = _sub(r"from google\.protobuf import runtime_version as _runtime_version\n", "", text)
    text = _sub(r"_runtime_version\.ValidateProtobufRuntimeVersion\(.*?\)\n", "", text, re.S)
    return NOTE + _sub(r"'pallasite\.v1\.generation_pb2'", repr(MODULE), text)


def fix_grpc(text: str) -> str:
    text = _sub(r"from pallasite\.v1 import generation_pb2", "from . import generation_pb2", text)
    return NOTE + _sub(r"GRPC_GENERATED_VERSION = .*?\n(?=\n\nclass )", "", text, re.S)


def main():
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{HERE}",
                        f"--python_out={tmp}", f"--grpc_python_out={tmp}", f"--pyi_out={tmp}",
                        str(HERE / PROTO)], check=True)
        out = Path(tmp) / "pallasite" / "v1"
        (HERE / "generation_pb2.py").write_text(fix_pb2((out / "generation_pb2.py").read_text()))
        (HERE / "generation_pb2.pyi").write_text((out / "generation_pb2.pyi").read_text())
        (HERE / "generation_pb2_grpc.py").write_text(
            fix_grpc((out / "generation_pb2_grpc.py").read_text()))
    print(f"wrote the stubs of {PROTO} into {HERE}")


if __name__ == "__main__":
    main()
