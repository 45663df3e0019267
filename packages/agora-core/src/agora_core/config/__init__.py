"""Run configuration (one TOML per run) and node-local settings (flags and AGORA_* env)."""

from agora_core.config.lifecycle import CheckpointConfig, JoinConfig, SyncConfig, TerminationConfig
from agora_core.config.loader import build, require
from agora_core.config.node import NodeSettings, resolve_settings
from agora_core.config.operator import OperatorConfig
from agora_core.config.run import (
    AdmissionConfig,
    AveragingConfig,
    ClippingConfig,
    DataConfig,
    DhtConfig,
    ModelConfig,
    OptimizerConfig,
    RunConfig,
    SurrogateConfig,
    TransportConfig,
    load_run_config,
    parse_run_config,
)

__all__ = [
    "AdmissionConfig",
    "AveragingConfig",
    "CheckpointConfig",
    "ClippingConfig",
    "DataConfig",
    "DhtConfig",
    "JoinConfig",
    "ModelConfig",
    "NodeSettings",
    "OperatorConfig",
    "OptimizerConfig",
    "RunConfig",
    "SurrogateConfig",
    "SyncConfig",
    "TerminationConfig",
    "TransportConfig",
    "build",
    "load_run_config",
    "parse_run_config",
    "require",
    "resolve_settings",
]
