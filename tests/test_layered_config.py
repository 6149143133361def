"""The layered layout's configuration: validation, settings file, environment and `serve --help`."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.cli.settings import build_config
from kvstore.config import StoreConfig
from kvstore.errors import InvalidInputError
from tests.conftest import kvsieve


def test_layout_defaults_to_layered() -> None:
    config = StoreConfig()
    assert (config.layout, config.layer_chunk_tokens) == ("layered", 8)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layout": "columns"}, "layout must be one of .*'columns'"),
        ({"layer_chunk_tokens": 12}, r"layer_chunk_tokens must be an integer dividing .*\(256\), got 12"),
        ({"layer_chunk_tokens": 0}, "layer_chunk_tokens .* got 0"),
        ({"block_tokens": 32, "chunk_tokens": 8, "layer_chunk_tokens": 64}, "layer_chunk_tokens .* got 64"),
    ],
)
def test_bad_layout_settings_are_refused_by_name(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        StoreConfig(**kwargs)  # type: ignore[arg-type]


def test_layout_travels_through_settings_file_and_environment(tmp_path: Path) -> None:
    toml = tmp_path / "kvsieve.toml"
    toml.write_text('[store]\nlayout = "importance"\nlayer_chunk_tokens = 16\n')
    from_file = build_config(StoreConfig, toml, env={}, section="store")
    assert (from_file.layout, from_file.layer_chunk_tokens) == ("importance", 16)  # not the default
    from_env = build_config(
        StoreConfig, env={"KVSIEVE_LAYOUT": "importance", "KVSIEVE_LAYER_CHUNK_TOKENS": "4"}
    )
    assert (from_env.layout, from_env.layer_chunk_tokens) == ("importance", 4)


def test_serve_offers_the_layout_flags() -> None:
    result = kvsieve("serve", "--help")
    assert result.returncode == 0, result.stderr
    assert "--layout" in result.stdout and "--layer-chunk-tokens" in result.stdout
