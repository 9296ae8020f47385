"""Generated engine-control gRPC modules (`proto/evolving_infra/v1/engine.proto`).

Never edit `engine_pb2*` by hand: `python -m evolving_infra.control.codegen` rewrites them, and
its `--check` (run by the tests) fails when they are stale.
"""
