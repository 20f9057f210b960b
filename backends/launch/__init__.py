"""A run from the command line to its report: inputs checked, the plan, calibration, the ranks started."""
