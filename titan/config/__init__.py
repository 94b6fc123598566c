from titan.config.job_config import JobConfig
from titan.config.manager import ConfigError, help_text, parse_args, to_toml, with_config_file

__all__ = ["JobConfig", "ConfigError", "help_text", "parse_args", "to_toml", "with_config_file"]
