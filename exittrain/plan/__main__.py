"""`python -m exittrain.plan`: the same as `python -m exittrain plan`."""

from exittrain.plan.command import main

main()
