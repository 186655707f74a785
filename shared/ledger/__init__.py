"""The GPU ledger in PostgreSQL: the authoritative record of GPUs and who holds which share of them."""
