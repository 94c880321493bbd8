"""`python -m rlft ...`: the `rlft` command (what torchrun starts: torchrun ... -m rlft train CONFIG)."""

from rlft.cli.app import main

main()
