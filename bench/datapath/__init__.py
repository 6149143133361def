"""The data path's benchmarks: a prefix's KV from the store to the model (store, transfer, ttft,
layout, readamp, remote, gpu), each against a floor measured in the same run (raw disk reads,
memcpy, a bare gRPC stream, plain Redis GETs, recomputing the prefix)."""
