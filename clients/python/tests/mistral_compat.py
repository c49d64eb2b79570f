"""`Mistral` from mistralai 2+ (`mistralai.client`) or 1.x (`mistralai`)."""

try:
    from mistralai.client import Mistral
except ImportError:  # mistralai 1.x
    from mistralai import Mistral  # type: ignore[attr-defined,no-redef]

__all__ = ["Mistral"]
