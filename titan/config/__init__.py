from titan.config.job_config import JobConfig
from titan.config.manager import ConfigError, help_text, parse_args, to_toml

__all__ = ["JobConfig", "ConfigError", "help_text", "parse_args", "to_toml"]
