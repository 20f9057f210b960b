"""`tinypipe run`'s options: the flags, the settled and checked settings, the typed record the planner reads."""
