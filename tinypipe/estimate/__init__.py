"""Estimates of a policy before it is simulated: the Plan, the analytic cost model, GPU and host memory, the floor."""
