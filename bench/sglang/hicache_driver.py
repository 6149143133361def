"""Drives kvsieve's SGLang HiCache backend with SGLang's own code; prints one JSON line.

Runs inside the SGLang environment (`bench/sglang/setup_sglang.sh`), never in kvsieve's:
SGLang's `StorageBackendFactory` loads `engine_adapter.sglang.backend.KvsieveStorage`
by "dynamic", SGLang's host KV pools (`MHATokenToKVPoolHost`, `MLATokenToKVPoolHost`,
built on the CPU) hold the pages, and real `kvsieve serve` sidecars, started here
with kvsieve's interpreter, store them.

    python THIS scenarios --kvsieve-python PY --work DIR   (what tests/test_sglang_hicache.py checks)
    python THIS bench --kvsieve-python PY --work DIR [--quick]   (bench/sglang/sglang_bench.py's figures)
    python THIS --check                                      (only import)

The scenarios are in bench/sglang/hicache_scenarios.py, the measurements in
bench/sglang/hicache_measure.py, what both drive in bench/sglang/hicache_parts.py;
this file only prepares the interpreter (torchvision's two schemas) and dispatches.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch


def _declare_torchvision_ops() -> Any:
    """Let torchvision's Python side import against the CPU torch (see radix_driver.py)."""
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    return lib  # must stay alive


_TORCHVISION_OPS = _declare_torchvision_ops()
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # kvsieve's checkout, whatever the cwd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("mode", nargs="?", choices=("scenarios", "bench"))
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--kvsieve-python", default=sys.executable)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--redis-url", help="scenarios: also share pages through this Redis")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the backend's expected misses log warnings
    from bench.sglang import hicache_measure, hicache_parts, hicache_scenarios

    if args.check or args.mode is None:
        hicache_parts.check_imports()
        print("sglang HiCache backend imports")
        return
    if args.work is None:
        parser.error("--work DIR is required")
    args.work.mkdir(parents=True, exist_ok=True)
    if args.mode == "scenarios":
        out = hicache_scenarios.scenarios(args.kvsieve_python, args.work, args.redis_url)
    else:
        out = hicache_measure.measure(args.kvsieve_python, args.work, quick=args.quick)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
