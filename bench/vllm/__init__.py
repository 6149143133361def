"""`kvsieve bench vllm`: time to first token in the real vLLM, with and without kvsieve's
connector, one request at a time and (`--concurrency C`) under a stream of requests."""
