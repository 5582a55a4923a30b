"""A run directory's ``config.toml`` loads back as the run's configuration for every method
and mode: it holds the resolved options, less those the method or mode does not use (which
the loader refuses by name where they are set)."""

from __future__ import annotations

import pytest

from editrain.config import dumps_toml, load_config, parse_overrides, to_dict
from editrain.config.applicability import drop_inapplicable
from editrain.launch.job import resolved

CASES = [["--method", m] for m in ("sync", "post_local_sgd", "diloco", "edit", "aedit")] + [
    ["--method", "edit", "--dist.pp_size", "2", "--model.tie_embeddings", "false"],
    ["--method", "edit", "--ft"],
]


@pytest.mark.parametrize("args", CASES, ids=" ".join)
def test_the_written_configuration_loads_back(tmp_path, args):
    cfg = load_config(None, parse_overrides(args)[0])
    path = tmp_path / "config.toml"
    path.write_text(dumps_toml(drop_inapplicable(to_dict(resolved(cfg)))))
    again = load_config(path)
    assert to_dict(resolved(again)) == to_dict(resolved(cfg))
