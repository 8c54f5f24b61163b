"""Resource managers: the accounting of each pool (mechanism, no policy)."""
from tangram.managers.base import CountingManager, ResourceManager

__all__ = ["CountingManager", "ResourceManager"]
