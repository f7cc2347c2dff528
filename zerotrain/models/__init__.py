"""Architectures zerotrain trains: the catalog of denoiser configs and model resolution (catalog), the
conditioning models and their encoders (conditioning), and tiny models for tests (tiny).

This __init__ imports nothing: the catalog asks the families (which build their tiny models' parts from
zerotrain.families.runtime.parts.tiny, below this package); importing one submodule must not import the others.
"""
