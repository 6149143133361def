"""Helper for test_relayout.py: run the re-layout job until killed."""

from __future__ import annotations

import sys

from kvstore.relayout import relayout

if __name__ == "__main__":
    print("ready", flush=True)
    relayout(sys.argv[1], min_change=0.0)
