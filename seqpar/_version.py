"""The version of seqpar (one place; ``seqpar.__version__`` reads it)."""

__version__ = "0.1.0"
