"""Builds the package, generating the gRPC stubs from the repository's .proto first.

The contract is `proto/proto/allot_api.proto` at the repository root (the same file the
Rust server is built from). `pip install ./clients/python` builds in place, so the file
is found two directories up; a source tree copied elsewhere can point ALLOT_PROTO_DIR at
the directory holding it.
"""

import os
import pathlib

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).resolve().parent
PROTO_DIR = pathlib.Path(os.environ.get("ALLOT_PROTO_DIR", HERE.parent.parent / "proto" / "proto"))
PROTO = "allot_api.proto"
GEN = HERE / "src" / "allot" / "_gen"


def generate():
    from grpc_tools import protoc
    import grpc_tools

    source = PROTO_DIR / PROTO
    if not source.is_file():
        raise SystemExit(f"allot-client: {source} not found (set ALLOT_PROTO_DIR)")
    GEN.mkdir(parents=True, exist_ok=True)
    (GEN / "__init__.py").write_text('"""Generated from allot_api.proto at build time."""\n')
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"-I{include}",
            f"--python_out={GEN}",
            f"--grpc_python_out={GEN}",
            str(source),
        ]
    )
    if rc != 0:
        raise SystemExit(f"allot-client: protoc failed ({rc})")
    # The generated service module imports its messages as a top-level module; make it
    # relative to the package.
    grpc_file = GEN / "allot_api_pb2_grpc.py"
    text = grpc_file.read_text()
    text = text.replace("import allot_api_pb2 as", "from . import allot_api_pb2 as")
    grpc_file.write_text(text)


class BuildWithStubs(build_py):
    def run(self):
        generate()
        super().run()


# Also before setuptools looks at the package list (egg_info checks that src/allot/_gen
# exists before any build step runs).
generate()
setup(cmdclass={"build_py": BuildWithStubs})
