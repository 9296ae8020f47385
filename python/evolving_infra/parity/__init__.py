"""`evolving-infra parity`: the simulator and the live system on one workload (command.py), and
the side-by-side figures with the bounds they must keep (compare.py)."""
