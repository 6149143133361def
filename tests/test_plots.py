"""The benchmark plots draw from the keys their benchmark publishes (matplotlib: the `bench` extra)."""

from __future__ import annotations

from pathlib import Path

from conftest import extra_installed, require_extra

if not extra_installed("bench"):
    require_extra("bench")  # matplotlib: skips this module, or fails it under KVSIEVE_REQUIRE_BENCH=1

from bench.common.plots import plot_longdoc


def test_longdoc_plot_has_a_column_per_length_measured(tmp_path: Path) -> None:
    result: dict[str, object] = {"model": "m"}
    for n in (4096, 8192):
        for method, quality in (("engine", 0.9), ("static", 0.8)):
            for tag, read in (("0_1", 0.1), ("0_25", 0.25)):
                result[f"answer_top1_{method}_{n}_{tag}"] = quality * read * 4
                result[f"answer_kl_{method}_{n}_{tag}"] = 1 - quality
                result[f"read_fraction_{method}_{n}_{tag}"] = read
    path = tmp_path / "longdoc.png"
    plot_longdoc(result, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(path) as image:  # two columns (4k, 8k) of 4.5 inches at 110 dpi
        assert image.size == (990, 770)
