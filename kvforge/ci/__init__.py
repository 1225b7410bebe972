"""Platforms as jobs: the command a hardware runner runs, the CI matrix and its renderings, and the
scaffold `kvforge init` writes.
"""
