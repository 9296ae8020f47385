"""`python -m evolving_infra.engines.pool`: measure the pool's transfer paths on loopback."""

from evolving_infra.engines.pool.transfer import main

raise SystemExit(main())
