"""The `pallasite.v1` gRPC API: `pallasite/v1/generation.proto` and its generated stubs
(regenerate with `python -m pallasite.serving.proto.generate`).

    from pallasite.serving.proto import pb, pb_grpc
    pb.GenerateRequest(text="Hello", sampling=pb.SamplingParams(max_tokens=8))
"""

from . import generation_pb2 as pb
from . import generation_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "pallasite.v1.Generation"
