"""Model architectures, one file each, and the registry from HF `architectures` names to classes."""
from workers.models.registry import get_model_class

__all__ = ["get_model_class"]
