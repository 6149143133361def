"""Bytes on disk and on the wire: chunk records, block metadata, layer records, key summaries.

Pure encoders and decoders over numpy: no tier, no index, no I/O. Every record carries
a checksum and its identity; docs/keys.md is the specification.
"""
