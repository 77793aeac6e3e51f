"""Fitting profiles to measurements: the A800 tables, this CPU, and error bands."""
