"""The memory planner: measured model facts, byte formulas, search, DeepSpeed JSON."""
