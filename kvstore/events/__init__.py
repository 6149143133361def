"""KV events for routers: what the store holds, published in vLLM's KV-event wire format.

`wire` (the message classes and frames), `hashing` (the router's block hashes over a block
size of its own), `publisher` (a bounded queue, a thread that publishes, the replay socket,
snapshots). Importing this package imports neither pyzmq nor msgspec: `publisher.open_publisher`
does, and names the missing extra (`pip install 'kvsieve[events]'`).
"""
