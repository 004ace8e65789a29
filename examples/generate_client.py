"""Stream one ``deepserve.v1.Generate`` call: token IDs in, token IDs out (README, "Other
backends (gRPC)"). ``python examples/generate_client.py [HOST:PORT]``; set DEEPSERVE_TOKEN to an
API key or the service token when the entrypoint has keys or a token configured."""

import os
import sys

import grpc

from libs.proto.deepserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc


def generate(address: str, prompt: list[int], max_tokens: int = 8, token: str = "") -> list[int]:
    metadata = [("authorization", f"Bearer {token}")] if token else []
    request = generate_pb2.GenerateRequest(
        prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=max_tokens)
    )
    out: list[int] = []
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)  # type: ignore[no-untyped-call]
        for event in stub.Generate(request, metadata=metadata, timeout=60):
            if event.HasField("tokens"):  # Ready, then Tokens..., then Finish
                out.extend(event.tokens.token_ids)
            elif event.HasField("finish"):
                print("finish:", event.finish.reason, file=sys.stderr)
    return out


if __name__ == "__main__":
    address = sys.argv[1] if len(sys.argv) > 1 else "localhost:50051"
    print(generate(address, [1, 2, 3, 4], token=os.environ.get("DEEPSERVE_TOKEN", "")))
