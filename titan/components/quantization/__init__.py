"""Low-precision training converters (float8)."""
