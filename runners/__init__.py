"""Backends that run an exported artifact, and the comparator that judges them."""
