"""The cross-check: run every backend, compare stage by stage, golden files, node localisation, reports."""
