"""Experiment configs (ml_collections), loaded with --config=configs/X.py."""
