"""Offline jobs over a data directory no server holds: `fsck` (verify, repair) and `relayout`."""
