"""The error minizero raises for a config it does not accept.

Its own module so that every module that checks a config section (config.py,
lr_schedules.py, checkpointing_config.py, fp16.py) can raise it without importing another.
"""


class ConfigError(ValueError):
    """A config key or value minizero does not accept. The message says what to do."""
