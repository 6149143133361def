"""kvsieve under vLLM: a KV connector that loads prefixes from a `kvsieve serve` sidecar.

`engine_adapter.vllm.connector.KVSieveConnector` is the class vLLM loads (it
imports vLLM); the other modules (settings, plan, layout, guard) import no vLLM
and are usable and testable without it. See docs/vllm.md.
"""
