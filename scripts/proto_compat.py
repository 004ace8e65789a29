#!/usr/bin/env python3
"""Fail on breaking changes to the gRPC/protobuf API against the last release's lock file.

    python scripts/proto_compat.py            # compare proto/ with proto/deepserve/v1/api-lock.json
    python scripts/proto_compat.py --update   # at a release: rewrite the lock from proto/ today

The lock describes what clients in other languages compiled against: per message its fields by
number (name, type, label, oneof), per enum its values by number, per service its methods
(request and response types, streaming). Breaking: anything in the lock that is gone or
different today -- a removed or renamed field, enum value, message, enum, service or method,
a changed field type, label or oneof, changed request/response types or streaming. Adding
fields, values, messages and methods is fine. A removed field breaks old clients even when its
number is reserved (they still send it and expect it back), so it waits for a release too.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
LOCK = PROTO_DIR / "deepserve" / "v1" / "api-lock.json"
PACKAGE = "deepserve."

Api = dict[str, dict[str, Any]]
_FDP = descriptor_pb2.FieldDescriptorProto
_TYPES = {v: k.removeprefix("TYPE_").lower() for k, v in _FDP.Type.items()}


def descriptor_set(proto_dir: Path = PROTO_DIR) -> descriptor_pb2.FileDescriptorSet:
    """Every .proto under ``proto_dir`` compiled by protoc (grpc_tools) into one set."""
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(proto_dir)) for p in proto_dir.rglob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "api.binpb"
        args = ["protoc", f"-I{proto_dir}", f"--descriptor_set_out={out}", *protos]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def _field(f: descriptor_pb2.FieldDescriptorProto, oneofs: list[str]) -> dict[str, Any]:
    if f.label == _FDP.LABEL_REPEATED:
        label = "repeated"
    elif f.proto3_optional or f.label == _FDP.LABEL_REQUIRED:
        label = "optional" if f.proto3_optional else "required"
    else:
        label = "singular"
    real_oneof = f.HasField("oneof_index") and not f.proto3_optional
    return {
        "name": f.name,
        "type": f.type_name.lstrip(".") if f.type_name else _TYPES[f.type],
        "label": label,
        "oneof": oneofs[f.oneof_index] if real_oneof else "",
    }


def _add_message(api: Api, prefix: str, m: descriptor_pb2.DescriptorProto) -> None:
    name = f"{prefix}.{m.name}"
    oneofs = [o.name for o in m.oneof_decl]
    api["messages"][name] = {str(f.number): _field(f, oneofs) for f in m.field}
    for nested in m.nested_type:
        _add_message(api, name, nested)
    for e in m.enum_type:
        _add_enum(api, name, e)


def _add_enum(api: Api, prefix: str, e: descriptor_pb2.EnumDescriptorProto) -> None:
    api["enums"][f"{prefix}.{e.name}"] = {str(v.number): v.name for v in e.value}


def describe(fds: descriptor_pb2.FileDescriptorSet) -> Api:
    """The lock's description of every file of the deepserve packages in ``fds``."""
    api: Api = {"messages": {}, "enums": {}, "services": {}}
    for f in fds.file:
        if not f.package.startswith(PACKAGE):
            continue
        for m in f.message_type:
            _add_message(api, f.package, m)
        for e in f.enum_type:
            _add_enum(api, f.package, e)
        for s in f.service:
            api["services"][f"{f.package}.{s.name}"] = {
                m.name: {
                    "input": m.input_type.lstrip("."),
                    "output": m.output_type.lstrip("."),
                    "client_streaming": m.client_streaming,
                    "server_streaming": m.server_streaming,
                }
                for m in s.method
            }
    return {k: dict(sorted(v.items())) for k, v in api.items()}


def breaking_changes(old: Api, new: Api) -> list[str]:
    """Every way ``new`` breaks a client built against ``old``; empty when compatible."""
    out: list[str] = []
    for kind, what, item in (
        ("messages", "message", "field"),
        ("enums", "enum", "value"),
        ("services", "service", "method"),
    ):
        for name, old_members in old.get(kind, {}).items():
            if name not in new.get(kind, {}):
                out.append(f"{what} {name} removed")
                continue
            new_members = new[kind][name]
            for key, was in old_members.items():
                now = new_members.get(key)
                label = f"{what} {name} {item} {key}"
                if now is None:
                    out.append(f"{label} removed")
                elif now != was:
                    out.append(f"{label} changed: {_diff(was, now)}")
    return out


def _diff(was: Any, now: Any) -> str:
    if not isinstance(was, dict):
        return f"{was!r} -> {now!r}"
    keys = [k for k in was if was[k] != now.get(k)]
    return ", ".join(f"{k} {was[k]!r} -> {now.get(k)!r}" for k in keys)


def dumps(api: Api) -> str:
    return json.dumps(api, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Fail on breaking changes to the gRPC API.")
    ap.add_argument("--update", action="store_true", help="rewrite the lock (at a release)")
    ap.add_argument("--lock", type=Path, default=LOCK)
    ap.add_argument("--proto-dir", type=Path, default=PROTO_DIR)
    args = ap.parse_args(argv)
    current = describe(descriptor_set(args.proto_dir))
    if args.update:
        args.lock.write_text(dumps(current))
        print(f"wrote {args.lock}")
        return 0
    if not args.lock.exists():
        print(f"proto_compat: no lock at {args.lock}; run with --update", file=sys.stderr)
        return 1
    problems = breaking_changes(json.loads(args.lock.read_text()), current)
    for p in problems:
        print(f"proto_compat: BREAKING: {p}", file=sys.stderr)
    if problems:
        print(
            f"proto_compat: {len(problems)} breaking change(s) against {args.lock}; keep the "
            "old API (add, do not change), or at a release run with --update",
            file=sys.stderr,
        )
        return 1
    print("proto_compat: no breaking changes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
