"""Outputs: scores and errors written in input order, atomically, with their metadata."""
