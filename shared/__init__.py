"""gpushare's common library: settings, logging, the event catalogue and bus, the ledger, placement."""
