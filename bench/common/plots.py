"""PNG plots of benchmark results (matplotlib, from the `bench` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    return plt


def plot_ttft(result: dict[str, Any], path: Path) -> None:
    """TTFT against prefix length for the four modes (log scale)."""
    plt = _pyplot()
    lengths = result["prefix_lengths"]
    fig, ax = plt.subplots(figsize=(6, 4))
    modes = {
        "recompute": "(a) recompute",
        "memory": "(b) load all, memory tier",
        "disk": "(c) load all, disk tier, cold",
        "budget": "(d) load top 25 %, cold",
    }
    for mode, label in modes.items():
        ax.plot(lengths, [result[f"ttft_{mode}_s_{n}"] for n in lengths], marker="o", label=label)
    ax.set_xlabel("prefix tokens (+ 32-token question)")
    ax.set_ylabel("time to first token (s)")
    ax.set_yscale("log")
    ax.set_xticks(lengths)
    ax.set_title(f"TTFT, {result['model']}, 2 CPU cores")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_readamp(result: dict[str, Any], path: Path) -> None:
    """Quality (top-1 agreement) per scorer and bytes read per layout, against budget."""
    plt = _pyplot()
    budgets = [0.1, 0.25, 0.5]
    tags = [f"{b:g}".replace(".", "_") for b in budgets]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("importance", "sink_recent", "recent", "raw_mass", "random"):
        left.plot(budgets, [result[f"top1_{name}_{t}"] for t in tags], marker="o", label=name)
    left.set_xlabel("budget (fraction of prefix tokens)")
    left.set_ylabel("top-1 agreement with the full prefix")
    left.set_title("quality")
    left.grid(True, alpha=0.3)
    left.legend()
    for layout in ("importance", "natural"):
        right.plot(budgets, [result[f"bytes_read_fraction_{layout}_{t}"] for t in tags], marker="o",
                   label=f"{layout} layout")  # fmt: skip
    right.plot(budgets, budgets, linestyle="--", color="grey", label="ideal (bytes = budget)")
    right.set_xlabel("budget (fraction of prefix tokens)")
    right.set_ylabel("fraction of the prefix's bytes read")
    right.set_title("bytes read")
    right.grid(True, alpha=0.3)
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_quality(result: dict[str, Any], path: Path) -> None:
    """Quality against bytes read (summaries included), one line per selection method."""
    plt = _pyplot()
    methods = [k.removeprefix("answer_top1_").removesuffix("_0_25") for k in result
               if k.startswith("answer_top1_") and k.endswith("_0_25")]  # fmt: skip
    panels = (("top1", "continuation top-1"), ("answer_top1", "answer top-1"), ("answer_kl", "answer KL"))
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4.2))
    for ax, (metric, title) in zip(axes, panels, strict=True):
        for method in methods:
            prefix = "cont_delivered_fraction" if metric == "top1" else "delivered_fraction"
            xs = [result[f"{prefix}_{method}_{t}"] for t in ("0_1", "0_25", "0_5")]
            ys = [result[f"{metric}_{method}_{t}"] for t in ("0_1", "0_25", "0_5")]
            (line,) = ax.plot(xs, ys, marker="o", label=method)
            ax.plot([result[f"{prefix}_{method}_auto"]], [result[f"{metric}_{method}_auto"]], marker="*",
                    markersize=11, color=line.get_color(), linestyle="none")  # fmt: skip
        ax.set_xlabel("fraction of the prefix's KV bytes read (summaries included)")
        ax.set_title(f"{title} vs the full prefix (star: auto)")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Partial prefix loads, {result.get('model', '')}, {result.get('windows', '?')} windows")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_longdoc(result: dict[str, Any], path: Path) -> None:
    """Answer quality against bytes read (summaries and top-ups included), one line per method,
    one column per document length measured."""
    plt = _pyplot()
    lengths = sorted({int(k.split("_")[-3]) for k in result if k.startswith("answer_top1_engine_")})
    rows = (("answer_top1", "answer top-1"), ("answer_kl", "answer KL"))
    fig, axes = plt.subplots(len(rows), len(lengths), figsize=(4.5 * len(lengths), 7), squeeze=False)
    for col, n in enumerate(lengths):
        for row, (metric, title) in enumerate(rows):
            ax = axes[row][col]
            for method in ("engine", "static"):
                tags = [t for t in ("0_1", "0_25") if f"{metric}_{method}_{n}_{t}" in result]
                xs = [result[f"read_fraction_{method}_{n}_{t}"] for t in tags]
                ax.plot(xs, [result[f"{metric}_{method}_{n}_{t}"] for t in tags], marker="o", label=method)
            ax.set_title(f"{title}, {n:,} tokens")
            ax.set_xlabel("fraction of the prefix's bytes read")
            ax.grid(True, alpha=0.3)
    axes[0][0].legend()
    fig.suptitle(f"Partial prefix loads through Engine, {result.get('model', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
