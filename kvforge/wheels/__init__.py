"""Patched release wheels: the release wheel's members copied raw, the series' files overlaid, RECORD
rewritten, identity recorded, verified by installing it.
"""
