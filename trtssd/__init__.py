"""trtssd: speculative speculative decoding (Saguaro) with target and draft in separate ranks."""

__version__ = "0.1.0"
