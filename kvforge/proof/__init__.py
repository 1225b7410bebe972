"""Proof: pytest runs with JUnit evidence judged against the base, per-patch verify, and which tests a
series touches (the CPU selection's coverage).
"""
