"""Plumbing every layer uses: errors and exit codes, the Outcome a command returns and its rendering
(tables, JSON), atomic files and crash points, the cache's layout, evidence records, the wheel format.
Imports nothing of kvforge above it.
"""
