"""`evolving-infra cluster`: a whole live system on loopback (see `command.py`)."""
