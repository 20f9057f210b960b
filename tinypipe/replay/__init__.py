"""Replaying a real run's trace in the simulator with its measured durations, and the report beside the prediction."""
