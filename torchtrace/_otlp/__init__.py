"""OTLP: calls encoded as protobuf or JSON lines and sent over gRPC / HTTP or written to a trace file."""
