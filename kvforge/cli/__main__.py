"""`python -m kvforge.cli`: the console script."""

from kvforge.cli import main

main()
