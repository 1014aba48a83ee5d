"""Models: the catalog store (pull, convert, cache) and loading by any kind of name."""

from speclm.models.loading import LoadedModel, load_model, resolve_model
from speclm.models.store import cached_models, model_home, pull

__all__ = ["LoadedModel", "load_model", "resolve_model", "cached_models", "model_home", "pull"]
