"""Variants of query-aware selection, compared at one budget (the exploration behind docs/importance.md).

    PYTHONPATH=$PWD OPENBLAS_NUM_THREADS=1 python -m bench.quality.variants --windows 4 --budget 0.25
    ... --prefix 4096 --variants shipped,H8,L4,imp8 --methods qa_lowbit2,qa_lowbit1,qa_probe2

Prints one line per (workload, variant:method) with the mean figures. Not a published
benchmark: `kvsieve bench quality` measures the shipped choice against the baselines. The
levers of issue #27 item 3 that did not ship stay here (docs/importance.md, "Cheaper summaries
and finer choices"): `qa_lowbit1`, `qa_probe2` / `qa_probe4` (one KV head a layer), `H8` (a
choice per KV head), `L4` (4-token chunks), `imp8` (chunks in importance order).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np

from bench.quality.methods import QAConfig
from bench.quality.quality_bench import PREFIX, QUESTIONS, SHIPPED_CONFIG, Job, evaluate

BASE = QAConfig()
VARIANTS = {
    "L16e11": replace(BASE, per_kv_head=False),
    "L16e12m3": replace(BASE, per_kv_head=False, recent_chunks=2, static_weight=0.3),
    "H8e22m3": replace(BASE, chunk_tokens=8, sink_chunks=2, recent_chunks=2, static_weight=0.3),
    "L8e22m3": replace(
        BASE, per_kv_head=False, chunk_tokens=8, sink_chunks=2, recent_chunks=2, static_weight=0.3
    ),
    "shipped": SHIPPED_CONFIG,
    # issue 27's finer choices at the shipped method's bytes: per KV head, 4-token chunks, and
    # 8-token chunks of each block's tokens in importance order (the importance layout inside a layer)
    "H8": replace(SHIPPED_CONFIG, per_kv_head=True),
    "L4": replace(SHIPPED_CONFIG, chunk_tokens=4, sink_chunks=4, recent_chunks=4),
    "imp8": replace(SHIPPED_CONFIG, layout="importance"),
    "base": BASE,
    "layer": replace(BASE, per_kv_head=False),
    "noedge": replace(BASE, sink_chunks=0, recent_chunks=0),
    "c8": replace(BASE, chunk_tokens=8),
    "mix3": replace(BASE, static_weight=0.3),
    "implayout": replace(BASE, layout="importance"),
}


def main() -> None:
    """Run the variants and print their figures."""
    from engine_adapter.runner.model import load_model

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--first", type=int, default=0, help="skip this many windows")
    parser.add_argument("--baselines", default="static,sink_recent,snapkv")
    parser.add_argument("--questions", type=int, default=2)
    parser.add_argument("--prefix", type=int, default=PREFIX, help="tokens of each window's cached prefix")
    parser.add_argument(
        "--budget", default="0.25", help="a fraction, or auto (the first variant's first method decides)"
    )
    parser.add_argument(
        "--prefix-auto", action="store_true", help="also each qa method with one count for all layers"
    )
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--methods", default="qa_lowbit2,qa_minmax,qa_mean,oracle")
    args = parser.parse_args()
    budget = args.budget if args.budget == "auto" else float(args.budget)
    jobs = [Job(m, m, budget, BASE) for m in args.baselines.split(",") if m]
    for name in args.variants.split(","):
        jobs += [Job(f"{name}:{m}", m, budget, VARIANTS[name]) for m in args.methods.split(",")]
        if args.prefix_auto:
            qa = [m for m in args.methods.split(",") if m.startswith("qa_")]
            jobs += [Job(f"{name}:{m}:prefix", m, budget, VARIANTS[name], "prefix") for m in qa]
    shipped = f"{args.variants.split(',')[0]}:{args.methods.split(',')[0]}"
    lm = load_model(quiet=True)
    records = evaluate(
        lm, args.windows, QUESTIONS[: args.questions], jobs, shipped, args.prefix, first=args.first
    )
    for (workload, label, _), rows in sorted(records.items()):
        means = {f: round(float(np.mean([r[f] for r in rows])), 3) for f in rows[0]}
        print(workload, label, means, flush=True)


if __name__ == "__main__":
    main()
