"""Architectures zerotrain trains: the catalog of denoiser configs and model resolution (catalog), the
conditioning models and their encoders (conditioning), and tiny models for tests (tiny, tiny_parts).

This __init__ imports nothing: the family modules build their tiny models from tiny_parts, below the
catalog, which asks the families; importing one submodule must not import the others.
"""
