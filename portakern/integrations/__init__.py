"""Glue between portakern and other frameworks.

Each submodule imports its framework when it is imported, never before: ``import portakern`` imports none of
them. ``portakern.integrations.transformers`` registers portakern's attention with Hugging Face transformers and
swaps a model's linear layers for portakern's quantized linear.
"""
