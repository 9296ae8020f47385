"""`evolving-infra soak`: sustained load on the live system with faults injected (command.py);
the figures it measures from outside the processes (probes.py) and its report (report.py)."""
