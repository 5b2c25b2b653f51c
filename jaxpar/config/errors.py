"""The error raised for a bad configuration."""


class ConfigError(ValueError):
    """A config key is unknown, has the wrong type, or conflicts with another; the message names the key and fix."""
