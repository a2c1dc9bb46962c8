"""The simulator: TP x PP x DP training under elastic-event traces, on the runtime's own
cost model and planners."""
