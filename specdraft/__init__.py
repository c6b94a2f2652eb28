"""specdraft: speculative decoding on CPU."""

__version__ = "0.1.0"
