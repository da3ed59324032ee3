"""Synthetic, offline DataModules for the recipes (no downloads)."""
