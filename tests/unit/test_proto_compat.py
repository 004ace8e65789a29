"""scripts/proto_compat.py: today's protos keep the locked API, and a break is caught."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import proto_compat  # noqa: E402


@pytest.fixture(scope="module")
def fds() -> descriptor_pb2.FileDescriptorSet:
    return proto_compat.descriptor_set()


def _file(fds: descriptor_pb2.FileDescriptorSet, name: str) -> descriptor_pb2.FileDescriptorProto:
    return next(f for f in fds.file if f.name == f"deepserve/v1/{name}")


def _message(f: descriptor_pb2.FileDescriptorProto, name: str) -> descriptor_pb2.DescriptorProto:
    return next(m for m in f.message_type if m.name == name)


def test_current_protos_keep_the_locked_api() -> None:
    assert proto_compat.main([]) == 0


def test_every_proto_names_its_language_packages(fds: descriptor_pb2.FileDescriptorSet) -> None:
    for f in fds.file:
        assert f.options.go_package.endswith(";deepservev1"), f.name
        assert f.options.java_package == "ai.deepserve.v1", f.name
        assert f.options.java_multiple_files, f.name


def test_additions_are_compatible(fds: descriptor_pb2.FileDescriptorSet) -> None:
    old = proto_compat.describe(fds)
    gen = _file(fds, "generate.proto")
    req = _message(gen, "GenerateRequest")
    req.field.add(name="new_field", number=99, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING)
    gen.message_type.add(name="NewMessage")
    gen.service[0].method.add(
        name="Count", input_type=".deepserve.v1.GenerateRequest", output_type=".deepserve.v1.Finish"
    )
    assert proto_compat.breaking_changes(old, proto_compat.describe(fds)) == []


def test_breaks_are_all_listed(fds: descriptor_pb2.FileDescriptorSet) -> None:
    old = proto_compat.describe(fds)
    gen = _file(fds, "generate.proto")
    req = _message(gen, "GenerateRequest")
    by_name = {f.name: f for f in req.field}
    by_name["model"].type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES  # type changed
    req.field.remove(by_name["tenant"])  # field removed
    by_name["request_id"].name = "id"  # field renamed
    gen.service[0].method[0].server_streaming = False  # streaming changed
    kv = _file(fds, "kvstore.proto").service[0]
    kv.method.remove(next(m for m in kv.method if m.name == "Delete"))  # method removed
    common = _file(fds, "common.proto")
    traffic = next(e for e in common.enum_type if e.name == "TrafficClass")
    traffic.value.pop()  # enum value removed

    problems = proto_compat.breaking_changes(old, proto_compat.describe(fds))

    assert sorted(problems) == sorted(
        [
            "message deepserve.v1.GenerateRequest field 4 changed: type 'string' -> 'bytes'",
            "message deepserve.v1.GenerateRequest field 5 removed",
            "message deepserve.v1.GenerateRequest field 1 changed: name 'request_id' -> 'id'",
            "service deepserve.v1.Generate method Generate changed: server_streaming True -> False",
            "service deepserve.v1.KVStore method Delete removed",
            "enum deepserve.v1.TrafficClass value 2 removed",
        ]
    )


def test_check_fails_and_update_rewrites(tmp_path: Path) -> None:
    lock = tmp_path / "api-lock.json"
    api = json.loads(proto_compat.LOCK.read_text())
    api["services"]["deepserve.v1.Generate"]["Cancel"] = {  # a method since removed
        "input": "deepserve.v1.Abort",
        "output": "deepserve.v1.Finish",
        "client_streaming": False,
        "server_streaming": False,
    }
    lock.write_text(json.dumps(api))
    assert proto_compat.main(["--lock", str(lock)]) == 1
    assert proto_compat.main(["--lock", str(lock), "--update"]) == 0
    assert proto_compat.main(["--lock", str(lock)]) == 0
    assert lock.read_text() == proto_compat.LOCK.read_text()
