"""The four gpushare services (extender, binder, node agent, accounting) and the `gpushare` CLI."""
