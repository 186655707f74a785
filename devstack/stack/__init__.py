"""`gpushare up`: the whole stack on one machine (control plane, Postgres, NATS, services, simulated nodes, demo)."""
