"""Run configuration: sections, TOML files, ``--section.key=value`` overrides and their checks.

One module per job:

* :mod:`~editrain.config.schema`: the dataclass of every section, with defaults and the
  one-line docstring of every field (``sync`` is :class:`editrain.sync.config.SyncConfig`);
* :mod:`~editrain.config.overrides`: command-line options, shorthands and flags;
* :mod:`~editrain.config.toml_io`: :func:`load_config` (a file and overrides, checked) and
  :func:`dumps_toml`;
* :mod:`~editrain.config.validation`: every check, each naming the option and what is
  allowed, raising :class:`~editrain.errors.ConfigError`;
* :mod:`~editrain.config.model`: the configured model's shape and sync units (no weights);
* :mod:`~editrain.config.describe`: the options as help text and reference documentation.

Shipped examples: ``examples/configs/*.toml`` (``editrain train --config FILE``).
"""

from editrain.config.describe import describe_options, field_docs
from editrain.config.model import model_config, sync_units
from editrain.config.overrides import FLAGS, SHORTHANDS, parse_overrides
from editrain.config.schema import (
    BACKENDS,
    DEVICES,
    FAULT_TOLERANCE,
    OPTIMIZERS,
    PRECISIONS,
    PRESETS,
    SAMS,
    SECTIONS,
    SEED_MAX,
    CheckpointSection,
    Config,
    DataSection,
    DistSection,
    ModelSection,
    OptimSection,
    SimSection,
    TrainSection,
)
from editrain.config.toml_io import dumps_toml, load_config, to_dict, toml_value
from editrain.config.validation import cuda_device_count, validate, validate_world
from editrain.errors import ConfigError

__all__ = [
    "BACKENDS",
    "DEVICES",
    "FAULT_TOLERANCE",
    "FLAGS",
    "OPTIMIZERS",
    "PRECISIONS",
    "PRESETS",
    "SAMS",
    "SECTIONS",
    "SEED_MAX",
    "SHORTHANDS",
    "CheckpointSection",
    "Config",
    "ConfigError",
    "DataSection",
    "DistSection",
    "ModelSection",
    "OptimSection",
    "SimSection",
    "TrainSection",
    "cuda_device_count",
    "describe_options",
    "dumps_toml",
    "field_docs",
    "load_config",
    "model_config",
    "parse_overrides",
    "sync_units",
    "to_dict",
    "toml_value",
    "validate",
    "validate_world",
]
