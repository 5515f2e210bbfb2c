#!/usr/bin/env python3
"""A gRPC client that knows nothing of Ferry's protos: Python's grpcio with its reflection client
(v1alpha, what grpcio-reflection, older grpcurl, Postman and Evans ask) lists the router's services,
fetches their file descriptors, builds the message classes from them and calls `Generate`.

Usage: grpc_client.py '{"addr": "127.0.0.1:PORT", "api_key": "..."}'
Prints "all checks passed" when every check holds; exits non-zero otherwise.
"""

import json
import sys

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

# What a router answers (clients, operators, and the workers registering): no worker services
# (Prefill, Decode, KvTransfer are the workers').
ROUTER_SERVICES = {"ferry.v1.Ferry", "ferry.v1.Admin", "ferry.v1.Registry"}
WORKER_SERVICES = {"ferry.v1.Prefill", "ferry.v1.Decode", "ferry.v1.KvTransfer"}


def ask(stub, **req):
    reply = next(iter(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(**req)]))))
    if reply.HasField("error_response"):
        raise SystemExit(f"reflection error for {req}: {reply.error_response}")
    return reply


def main():
    args = json.loads(sys.argv[1])
    channel = grpc.insecure_channel(args["addr"])
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)

    listed = {s.name for s in ask(stub, list_services="").list_services_response.service}
    print("v1alpha lists:", sorted(listed))
    assert "ferry.v1.Ferry" in listed, listed
    assert not (listed & WORKER_SERVICES), f"the router lists services it does not answer: {listed & WORKER_SERVICES}"
    assert ROUTER_SERVICES <= listed <= ROUTER_SERVICES | {"grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"}, listed

    # The descriptors of ferry.v1.Ferry and everything it imports, into a pool of our own.
    pool = descriptor_pool.DescriptorPool()
    files = {}
    for raw in ask(stub, file_containing_symbol="ferry.v1.Ferry").file_descriptor_response.file_descriptor_proto:
        fd = descriptor_pb2.FileDescriptorProto.FromString(raw)
        files[fd.name] = fd
    added = set()

    def add(name):
        if name in added:
            return
        if name not in files:
            for raw in ask(stub, file_by_filename=name).file_descriptor_response.file_descriptor_proto:
                fd = descriptor_pb2.FileDescriptorProto.FromString(raw)
                files.setdefault(fd.name, fd)
        for dep in files[name].dependency:
            add(dep)
        pool.Add(files[name])
        added.add(name)

    for name in list(files):
        add(name)
    service = pool.FindServiceByName("ferry.v1.Ferry")
    method = service.methods_by_name["Generate"]
    Request = message_factory.GetMessageClass(method.input_type)
    Response = message_factory.GetMessageClass(method.output_type)
    print("Generate:", method.input_type.full_name, "->", method.output_type.full_name)

    # Built from the descriptors alone: a greedy prompt under a repetition penalty.
    req = Request()
    req.prompt = "The capital of France is"
    req.sampling.temperature = 0.0
    req.sampling.repetition_penalty = 1.2
    req.stop.max_tokens = 8
    call = channel.unary_stream("/ferry.v1.Ferry/Generate", request_serializer=lambda m: m.SerializeToString(), response_deserializer=Response.FromString)
    metadata = [("authorization", f"Bearer {args['api_key']}")] if args.get("api_key") else []
    text, final = "", None
    for msg in call(req, metadata=metadata, timeout=120):
        kind = msg.WhichOneof("event")
        if kind == "delta":
            text += msg.delta.text
        elif kind == "final":
            final = msg.final
    assert final is not None, "no final message"
    assert final.completion_tokens >= 1 and text, (text, final)
    print(f"Generate answered {final.completion_tokens} tokens: {text!r}")
    print("all checks passed")


if __name__ == "__main__":
    main()
