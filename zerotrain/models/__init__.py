"""Architectures zerotrain trains: the catalog of denoiser configs and model resolution."""

from zerotrain.models.catalog import FAMILIES, ModelSpec, catalog_names, resolve_model

__all__ = ["FAMILIES", "ModelSpec", "catalog_names", "resolve_model"]
