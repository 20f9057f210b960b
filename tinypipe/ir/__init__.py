"""The schedule IR: action kinds, Actions on per-resource lists, when each may run, the memory ledger, timelines."""
