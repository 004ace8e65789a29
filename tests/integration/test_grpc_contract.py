"""The gRPC contract other backends rely on, against a real stack: every gRPC server answers
reflection and health without a credential (even where every other RPC needs the service
token), and the Python client of docs/api.md (examples/generate_client.py) streams tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from deepserve.up import REPO_ROOT, Stack

STANDARD = {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
EXPECTED = {
    "entrypoint": ("deepserve.v1.Generate", "Generate"),
    "kvstore": ("deepserve.v1.KVStore", "Lookup"),
    "decode": ("deepserve.v1.KVTransfer", "Push"),
}


def _address(stack: Stack, service: str) -> str:
    if service == "entrypoint":
        return stack.grpc_address
    child = next(c for c in stack.children if c.service == service and c.grpc_port)
    return f"127.0.0.1:{child.grpc_port}"


@pytest.mark.parametrize("service", sorted(EXPECTED))
def test_reflection_and_health_answer_without_a_credential(stack: Stack, service: str) -> None:
    name, method = EXPECTED[service]
    with grpc.insecure_channel(_address(stack, service)) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        assert set(db.get_services()) == {name, *STANDARD}
        # The descriptors come over the wire too: a client needs no copy of the protos.
        found = DescriptorPool(db).FindServiceByName(name)
        assert method in found.methods_by_name
        health = health_pb2_grpc.HealthStub(channel)
        for svc in ("", name):
            reply = health.Check(health_pb2.HealthCheckRequest(service=svc), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, (service, svc)


def test_internal_rpcs_still_need_the_token(stack: Stack) -> None:
    from libs.proto.deepserve.v1 import kvstore_pb2, kvstore_pb2_grpc

    with grpc.insecure_channel(_address(stack, "kvstore")) as channel:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)  # type: ignore[no-untyped-call]
        with pytest.raises(grpc.RpcError) as err:
            stub.Stats(kvstore_pb2.StatsRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_readme_python_client_streams_tokens(stack: Stack) -> None:
    token = dict(stack.call_metadata)["authorization"].removeprefix("Bearer ")
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / "generate_client.py"), stack.grpc_address],
        cwd=REPO_ROOT,
        env={**os.environ, "DEEPSERVE_TOKEN": token},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    tokens = json.loads(proc.stdout)  # the printed list of token IDs
    assert isinstance(tokens, list) and 0 < len(tokens) <= 8
    assert all(isinstance(t, int) for t in tokens)
    assert "finish:" in proc.stderr


# Bytes that are no protobuf message: a server that parses a body before the credential never
# answers UNAUTHENTICATED for them (grpc.aio gives no answer at all until the deadline).
GARBAGE = b"\xff\xff\xff\xff\x0f"
UNREAD = {  # each gRPC server's method that takes one message, and its streaming shape
    "entrypoint": ("/deepserve.v1.Generate/Generate", "unary_stream"),
    "kvstore": ("/deepserve.v1.KVStore/Lookup", "unary_unary"),
    "decode": ("/deepserve.v1.KVTransfer/Resend", "unary_unary"),
}


@pytest.mark.parametrize("service", sorted(UNREAD))
def test_a_call_without_a_credential_is_refused_before_its_body_is_read(
    stack: Stack, service: str
) -> None:
    """Issue 33's probe: gRPC parsed a stranger's body before checking the credential."""
    method, shape = UNREAD[service]
    with grpc.insecure_channel(_address(stack, service)) as channel:
        call = getattr(channel, shape)(method)  # no (de)serializers: raw bytes both ways
        with pytest.raises(grpc.RpcError) as err:
            reply = call(GARBAGE, timeout=10)
            if shape == "unary_stream":
                list(reply)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (service, err.value.details())


def test_an_unknown_traffic_class_is_refused_naming_the_field(stack: Stack) -> None:
    from libs.proto.deepserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc

    request = generate_pb2.GenerateRequest(
        prompt_token_ids=[1, 2, 3],
        sampling=common_pb2.SamplingParams(max_tokens=2),
        traffic_class=99,  # type: ignore[arg-type]
    )
    with grpc.insecure_channel(stack.grpc_address) as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)  # type: ignore[no-untyped-call]
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request, timeout=30, metadata=stack.call_metadata))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "traffic_class" in (err.value.details() or "")
